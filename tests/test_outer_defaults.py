"""The outer step by (N, H): used when the config sets none of outer.lr/momentum/nesterov; explicit values win."""

from __future__ import annotations

from diloco_serverless.config import OUTER_DEFAULTS, RunConfig, outer_defaults


def _outer(*overrides: str) -> tuple[float, float, bool]:
    cfg = RunConfig.load(None, list(overrides))
    return cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov


def test_unset_outer_takes_the_measured_default_for_n_and_h() -> None:
    for (n, h, delay), want in OUTER_DEFAULTS.items():
        assert _outer(f"replicas={n}", f"inner.sync_every={h}", f"outer.delay={delay}") == want


def test_the_nearest_measured_point_answers_for_the_others() -> None:
    assert outer_defaults(5, 30) == OUTER_DEFAULTS[(4, 32, 0)]
    assert outer_defaults(4, 9, delay=1) == OUTER_DEFAULTS[(4, 8, 1)]


def test_explicit_values_win_and_a_partial_setting_keeps_the_static_defaults() -> None:
    assert _outer("outer.lr=0.7", "outer.momentum=0.9", "outer.nesterov=true") == (0.7, 0.9, True)
    assert _outer("outer.lr=0.5") == (0.5, 0.9, True)  # the others: the field defaults (DiLoCo's)
    assert _outer("outer.momentum=0.3") == (0.7, 0.3, True)


def test_the_chosen_default_survives_run_json() -> None:
    cfg = RunConfig.load(None, ["replicas=4", "inner.sync_every=8"])
    again = RunConfig.from_dict(cfg.to_json_dict())
    assert again.outer == cfg.outer
    # a later change of N does not silently change a stored run's outer step
    assert cfg.with_overrides(["replicas=8"]).outer == cfg.outer
