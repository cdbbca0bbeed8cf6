"""The pure parts of `bench/scale_anchor.py`: KCM's flags per setting, one
round's figures and the headline over rounds (a round cut short has no ratio
and does not count); the JobSet column (its body, client limit, the
rotating burst order, Cairn ÷ JobSet + KCM) and `--settings`."""

import collections
import importlib
import pathlib
import sys
from typing import Any

import pytest

from cairn.operator.core import tunables

# The benches are scripts that import each other as neighbours (`import record`),
# not a package: loaded by name with bench/ appended to the path, so none of their
# names can shadow an installed module.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
operator_scale: Any = importlib.import_module("operator_scale")
scale_anchor: Any = importlib.import_module("scale_anchor")


def _burst(latencies: list[float], cpu: float) -> operator_scale.Burst:
    return operator_scale.Burst(
        latencies=sorted(latencies),
        create_seconds=1.0,
        all_seconds=max(latencies, default=0.0),
        operator_cpu=cpu,
        requests=collections.Counter({"POST pods": 20}),
    )


def test_default_setting_adds_no_flag() -> None:
    assert scale_anchor.DEFAULT.flags() == []


def test_fair_setting_matches_the_operators_threads() -> None:
    threads = tunables.DEFAULT.reconcile.api_threads
    assert scale_anchor.FAIR.flags() == [
        "--kube-api-qps=1000",
        "--kube-api-burst=2000",
        f"--concurrent-job-syncs={threads}",
    ]


def test_figures_divide_cairn_by_the_job_controller() -> None:
    pair = scale_anchor.Pair(
        cairn=_burst([1.0, 2.0, 4.0], cpu=3.0),
        batch=_burst([2.0, 4.0, 8.0], cpu=0.0),
        kcm_cpu_cairn=0.5,
        kcm_cpu_batch=1.5,
    )
    got = scale_anchor.figures(pair, jobs=10)
    assert got["ratio_p50_p95"] == [0.5, 0.5]
    assert got["ratio_cpu"] == 2.0
    assert got["requests_per_job_cairn_job"] == [2.0, 2.0]


def test_a_burst_without_pods_has_no_latency_ratio() -> None:
    pair = scale_anchor.Pair(
        cairn=_burst([], cpu=1.0),
        batch=_burst([1.0], cpu=0.0),
        kcm_cpu_cairn=0.0,
        kcm_cpu_batch=0.0,
    )
    got = scale_anchor.figures(pair, jobs=1)
    assert "ratio_p50_p95" not in got
    assert "ratio_cpu" not in got  # KCM used no CPU: no division by zero


def test_headline_is_the_median_of_complete_rounds() -> None:
    rounds: list[dict[str, Any]] = [
        {"ratio_p50_p95": [1.0, 2.0], "ratio_cpu": 3.0},
        {"ratio_p50_p95": [3.0, 4.0], "ratio_cpu": 5.0},
        {"ratio_p50_p95": [5.0, 6.0], "ratio_cpu": 7.0},
        {"ratio_cpu": 100.0},  # cut short
    ]
    got = scale_anchor.headline(rounds)
    assert got["ratio_p50_median"] == 3.0
    assert got["ratio_p95_median"] == 4.0
    assert got["ratio_cpu_median"] == 5.0
    assert got["ratio_cpu_each"] == [3.0, 5.0, 7.0]


def test_headline_of_no_complete_round_is_none() -> None:
    assert scale_anchor.headline([{"ratio_cpu": 1.0}])["ratio_p50_median"] is None


def test_jobset_body_has_the_indexed_jobs_pods() -> None:
    body = scale_anchor.jobset_body("jobset-0001", 3)
    job = body["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 1
    assert job["template"]["spec"]["completions"] == job["template"]["spec"]["parallelism"] == 3
    twin = operator_scale.indexed_job("jobset-0001", 3)["spec"]["template"]
    assert job["template"]["spec"]["template"] == twin


def test_jobset_gets_the_fair_client_limit_else_its_own_default() -> None:
    fair = scale_anchor.FAIR.jobset_limits()
    assert (fair.qps, fair.burst) == (1000, 2000)
    default = scale_anchor.DEFAULT.jobset_limits()
    assert (default.qps, default.burst) == (500, 500)


def test_round_order_rotates_so_each_kind_goes_first_in_turn() -> None:
    kinds = ("cairn", "batch", "jobset")
    got = [scale_anchor.round_order(kinds, i)[0] for i in range(4)]
    assert got == ["cairn", "batch", "jobset", "cairn"]
    assert scale_anchor.round_order(kinds[:2], 1) == ("batch", "cairn")


def test_jobset_column_divides_cairn_by_jobset_and_kcm_together() -> None:
    pair = scale_anchor.Pair(
        cairn=_burst([2.0, 4.0, 8.0], cpu=6.0),
        batch=_burst([1.0, 2.0, 4.0], cpu=0.0),
        kcm_cpu_cairn=0.5,
        kcm_cpu_batch=1.5,
        jobset=_burst([1.0, 2.0, 4.0], cpu=0.0),
        kcm_cpu_jobset=1.0,
        jobset_cpu_jobset=2.0,
    )
    got = scale_anchor.figures(pair, jobs=10)
    assert got["ratio_p50_p95_vs_jobset"] == [2.0, 2.0]
    assert got["ratio_cpu_vs_jobset"] == 2.0  # 6 s ÷ (2 s JobSet + 1 s KCM)
    assert got["jobset_pods_for"] == 3
    head = scale_anchor.headline([got])
    assert head["ratio_p50_vs_jobset_median"] == 2.0
    assert head["ratio_cpu_median"] == 4.0  # the Job controller column is unchanged


def test_a_round_without_jobset_has_no_jobset_headline() -> None:
    pair = scale_anchor.Pair(
        cairn=_burst([1.0], cpu=1.0), batch=_burst([1.0], cpu=0.0),
        kcm_cpu_cairn=0.0, kcm_cpu_batch=1.0,
    )  # fmt: skip
    got = scale_anchor.figures(pair, jobs=1)
    assert not any("jobset" in key for key in got)
    assert not any("jobset" in key for key in scale_anchor.headline([got]))


def test_settings_parse_in_order_and_refuse_unknown_names() -> None:
    assert scale_anchor.parse_settings("default, fair") == [scale_anchor.DEFAULT, scale_anchor.FAIR]
    for bad in ("fast", ""):
        with pytest.raises(SystemExit, match="--settings"):
            scale_anchor.parse_settings(bad)
