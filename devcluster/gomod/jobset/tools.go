//go:build tools

// Package tools pins the JobSet manager command the scale anchor bench builds.
package tools

import (
	_ "sigs.k8s.io/jobset"
)
