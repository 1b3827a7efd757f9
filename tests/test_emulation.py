"""Serial tests of mpidl.distributed.emulation (EMULATED slow ranks and links; no real waiting)."""

import pytest

from mpidl.distributed.emulation import LinkModel, Slowdown, parse_link, parse_slowdowns


def test_slowdown_sleeps_factor_minus_one_times_the_interval():
    slept = []
    slow = Slowdown(3.0, sleep=slept.append)
    assert slow.stretch(0.5) == pytest.approx(1.0)
    assert slow.stretch(0.25) == pytest.approx(0.5)
    assert slept == pytest.approx([1.0, 0.5])


def test_slowdown_of_one_never_sleeps():
    slept = []
    slow = Slowdown(1, sleep=slept.append)
    assert slow.stretch(2.0) == 0.0
    assert slept == []


@pytest.mark.parametrize("factor", [0.5, 0, -1, float("inf"), float("nan"), True, "2"])
def test_slowdown_refuses_bad_factors(factor):
    with pytest.raises(ValueError, match="slowdown factor"):
        Slowdown(factor)


def test_parse_slowdowns():
    assert parse_slowdowns("1,1,2,4", 4) == [1.0, 1.0, 2.0, 4.0]
    for text, size, match in [("1,2", 3, "2 entries.*3 ranks"), ("1,a", 2, "entry 1"),
                              ("1,0.5", 2, ">= 1"), ("", 1, "entry 0"), ("1,nan", 2, "finite")]:
        with pytest.raises(ValueError, match=match):
            parse_slowdowns(text, size)


def test_link_model_alpha_beta_formulas():
    link = LinkModel(latency_us=50, gbit_s=1)
    assert link.alpha == pytest.approx(50e-6)
    assert link.beta == pytest.approx(125e6)  # bytes per second
    n = 4_000_000
    # ring allreduce among L: 2 (L-1) (alpha + n / (L beta))
    assert link.allreduce_seconds(n, 2) == pytest.approx(2 * 1 * (50e-6 + n / (2 * 125e6)))
    assert link.allreduce_seconds(n, 4) == pytest.approx(2 * 3 * (50e-6 + n / (4 * 125e6)))
    # nobody to talk to: no time
    assert link.allreduce_seconds(n, 1) == 0.0
    assert "EMULATED" in link.describe()


def test_parse_link_and_its_errors():
    assert parse_link("50,1") == LinkModel(50.0, 1.0)
    assert parse_link(" 0 , 100 ") == LinkModel(0.0, 100.0)
    for text, match in [("50", "LATENCY_US,GBIT_S"), ("50,1,2", "LATENCY_US,GBIT_S"),
                        ("a,1", "entry 0"), ("-1,1", "latency_us"), ("50,0", "gbit_s")]:
        with pytest.raises(ValueError, match=match):
            parse_link(text)
