"""Serial tests of mpidl.distributed.emulation (EMULATED slow ranks and links; no real waiting)."""

import pytest

from mpidl.distributed.emulation import LinkModel, Slowdown, parse_link, parse_slowdowns


class FakeClock:
    """A clock that only sleeping moves, each sleep ``late`` seconds longer than asked."""

    def __init__(self, late=0.0):
        self.now, self.late, self.asked = 0.0, late, []

    def sleep(self, seconds):
        self.asked.append(seconds)
        self.now += seconds + self.late

    def __call__(self):
        return self.now


def test_slowdown_sleeps_factor_minus_one_times_the_interval():
    clock = FakeClock()
    slow = Slowdown(3.0, sleep=clock.sleep, clock=clock)
    assert slow.stretch(0.5) == pytest.approx(1.0)
    assert slow.stretch(0.25) == pytest.approx(0.5)
    assert clock.asked == pytest.approx([1.0, 0.5])


def test_slowdown_learns_the_sleeps_lateness_and_returns_what_it_slept():
    # every sleep returns 1 ms late: the first interval is 1 ms long (and says so); then the
    # asked time shrinks until the emulated interval is (f - 1) t again
    clock = FakeClock(late=1e-3)
    slow = Slowdown(2.0, sleep=clock.sleep, clock=clock)
    slept = [slow.stretch(0.010) for _ in range(40)]
    assert slept[0] == pytest.approx(0.011)
    assert slept[-1] == pytest.approx(0.010, abs=1e-6)
    assert clock.asked[-1] == pytest.approx(0.009, abs=1e-6)
    # a short interval never asks for less than half of its extra time
    assert slow.stretch(1e-3) == pytest.approx(0.5e-3 + 1e-3)


def test_slowdown_of_one_never_sleeps():
    clock = FakeClock()
    slow = Slowdown(1, sleep=clock.sleep, clock=clock)
    assert slow.stretch(2.0) == 0.0
    assert clock.asked == []


def test_slowdown_on_the_cpu_clock_makes_the_interval_last_factor_times_its_cpu_seconds():
    clock = FakeClock()
    slow = Slowdown(3.0, "cpu", sleep=clock.sleep, clock=clock)
    # a rank that had its core: wall = cpu, the same sleep as on the wall clock
    assert slow.stretch(0.5, 0.5) == pytest.approx(1.0)
    # a rank that waited 0.5 s for a core another rank held: that wait is not multiplied
    assert slow.stretch(1.0, 0.5) == pytest.approx(0.5)
    # waiting longer than the emulated interval: no sleep, the interval is its wall time
    assert slow.stretch(2.0, 0.5) == 0.0
    assert clock.asked == pytest.approx([1.0, 0.5])
    assert Slowdown(1.0, "cpu").extra_seconds(2.0) == 0.0  # factor 1 needs no CPU time
    with pytest.raises(ValueError, match="needs the interval's cpu_seconds"):
        slow.extra_seconds(1.0)


def test_slowdown_refuses_an_unknown_clock():
    with pytest.raises(ValueError, match="emulation clock must be one of wall, cpu"):
        Slowdown(2.0, "gpu")


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
