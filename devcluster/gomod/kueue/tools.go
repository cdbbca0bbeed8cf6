//go:build tools

// Package tools pins the Kueue manager command the devcluster builds.
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
