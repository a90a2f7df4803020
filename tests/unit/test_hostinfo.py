"""The CPU reader every host key and benchmark record uses, and the benchmarks' ABBA pairing."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.hostinfo import VECTOR_FLAGS, cpu_flags, cpu_name, cpuinfo_field, machine_facts

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.abba import abba_pairs, ratio_quartiles  # noqa: E402

names = st.text(st.characters(whitelist_categories=("L", "N"), whitelist_characters=" ()-@."), min_size=1,
                max_size=40).map(str.strip).filter(bool)


@settings(max_examples=40, deadline=None)
@given(name=names, flags=st.lists(st.sampled_from([*VECTOR_FLAGS, "sse4_2", "avx", "ht"]), unique=True),
       cores=st.integers(1, 4))
def test_the_first_cores_fields_are_read(tmp_path_factory, name: str, flags: list[str], cores: int) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("cpu") / "cpuinfo"
    blocks = [f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: {name if i == 0 else 'other'}\n"
              f"flags\t\t: {' '.join(flags)}\n" for i in range(cores)]
    path.write_text("\n".join(blocks))
    assert cpuinfo_field("model name", path) == cpu_name(path) == name
    assert cpu_flags(path) == set(flags)
    facts = machine_facts(path)
    assert facts["cpu_model"] == name and facts["cpu_flags"] == [f for f in VECTOR_FLAGS if f in flags]
    assert cpuinfo_field("bogomips", path) is None


def test_an_unreadable_cpuinfo_falls_back(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    assert cpuinfo_field("model name", missing) is None and cpu_flags(missing) == set()
    assert cpu_name(missing)  # platform's guess, never empty
    assert machine_facts(missing)["cpu_flags"] == []


@settings(max_examples=40, deadline=None)
@given(a=st.floats(1.0, 100.0), b=st.floats(1.0, 100.0), drift=st.floats(-0.5, 0.5), pairs=st.integers(1, 9))
def test_abba_cancels_a_linear_drift(a: float, b: float, drift: float, pairs: int) -> None:
    """A host that slows (or speeds up) linearly over the run: each pair's means are the sides'
    own times plus the same drift, so B - A per pair is exact; each half of a pair is two calls."""
    calls: list[tuple[bool, int]] = []

    def time_side(side_b: bool, half: int) -> float:
        calls.append((side_b, half))
        return (b if side_b else a) + drift * len(calls)

    a_times, b_times = abba_pairs(time_side, pairs)
    assert len(a_times) == len(b_times) == pairs
    for x, y in zip(a_times, b_times, strict=True):
        assert abs((y - x) - (b - a)) < 1e-9
    assert [h for _, h in calls] == [0, 0, 1, 1] * pairs
    for i in range(pairs):  # ABBA, then BAAB
        assert [s for s, _ in calls[4 * i:4 * i + 4]] == ([False, True, True, False] if i % 2 == 0 else
                                                          [True, False, False, True])
    quartiles = ratio_quartiles(a_times, b_times)
    assert quartiles["q1"] <= quartiles["median"] <= quartiles["q3"]
