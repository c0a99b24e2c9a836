"""The kernel cache's key follows the CPU description the schedules plan for."""

from lighthouse import kernel_cache
from lighthouse.targets.description import host_cpu


def test_fingerprint_follows_the_cpu_description_within_a_process(monkeypatch):
    """A process that re-reads LIGHTHOUSE_CPU between two compiles (an A/B of two cache
    sizes: host_cpu.cache_clear()) must not get the first description's kernel for the
    second."""
    monkeypatch.setenv("LIGHTHOUSE_CPU", "l2=1M")
    host_cpu.cache_clear()
    first = kernel_cache.fingerprint()
    assert kernel_cache.fingerprint() == first
    monkeypatch.setenv("LIGHTHOUSE_CPU", "l2=256K")
    host_cpu.cache_clear()
    try:
        assert kernel_cache.fingerprint() != first
    finally:
        monkeypatch.undo()
        host_cpu.cache_clear()
