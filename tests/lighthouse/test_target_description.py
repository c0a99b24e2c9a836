"""The target description the families read (lighthouse.targets.description): the host
CPU's detection, the families' parameters derived from it (never from a target's name), the
kernel file's schedule options parsed in one place, and check errors that are bugs."""

import pytest
from torch_mlir import ir

import schedules.attention.fuse
import schedules.cross_entropy.plan
import transform_ext
from lighthouse.compile import compile_kernel
from lighthouse.errors import UnsupportedError
from lighthouse.families import GENERIC, MATMUL, family_params, parse_schedule_options
from lighthouse.targets.cpu import CpuTarget
from lighthouse.targets.description import (FALLBACK_CACHE_BYTES, CpuDescription, cache_sizes,
                                            cpu_flags, describe_cpu, host_cpu, with_overrides)
from lighthouse.targets.xegpu import XeGpuTarget
from tests.conftest import EXAMPLES, run_cli
from tests.transform_ext.helpers import check as filecheck

SSE = CpuDescription(vector_bits=128, vector_registers=16, l1d_bytes=32 << 10,
                     l2_bytes=256 << 10, l3_bytes=8 << 20, threads=4)
ATTENTION = dict(B=1, H=2, S=24, D=8)


def _sysfs_cache(root, *entries):
    for i, (level, kind, size) in enumerate(entries):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "type").write_text(f"{kind}\n")
        (index / "size").write_text(f"{size}\n")
    return root


def test_cache_sizes_are_read_from_sysfs(tmp_path):
    root = _sysfs_cache(tmp_path / "cache", (1, "Data", "48K"), (1, "Instruction", "64K"),
                        (2, "Unified", "2048K"), (3, "Unified", "480M"))
    assert cache_sizes(root) == {1: 48 << 10, 2: 2 << 20, 3: 480 << 20}


def test_missing_caches_fall_back(tmp_path):
    root = _sysfs_cache(tmp_path / "cache", (1, "Data", "32K"), (2, "Unified", "oops"))
    assert cache_sizes(root) == {1: 32 << 10}
    assert cache_sizes(tmp_path / "absent") == {}
    cpu = describe_cpu(frozenset(), cache_sizes(root), 3)
    assert (cpu.l1d_bytes, cpu.l2_bytes, cpu.l3_bytes) == \
        (32 << 10, FALLBACK_CACHE_BYTES[2], FALLBACK_CACHE_BYTES[3])


def test_the_vector_unit_comes_from_the_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma\nbugs\t\t: none\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse4_2", "avx", "avx2", "fma"}
    assert cpu_flags(tmp_path / "absent") == frozenset()
    for flags, bits, registers in ((cpu_flags(cpuinfo), 256, 16), ({"avx", "avx2", "avx512f"}, 512, 32),
                                   ({"avx"}, 128, 16), (frozenset(), 128, 16)):
        cpu = describe_cpu(frozenset(flags), {}, 1)
        assert (cpu.vector_bits, cpu.f32_lanes, cpu.vector_registers) == (bits, bits // 32, registers)


def test_the_cpu_target_holds_the_host_description():
    assert CpuTarget().cpu == host_cpu()
    assert host_cpu().threads >= 1 and host_cpu().l1d_bytes > 0


def test_the_generic_script_reads_the_description():
    """A 128-bit CPU with 16 registers and 256 KiB of L2: vector tiles of 4 x 4 lanes, 4 x 8
    register tiles, parallel tiles of at most 16 KiB (and 16 KiB, half of L1, for a chain
    of several passes over its tile), inserts of up to 64 elements left whole (a 16-bit
    transpose's 8 x 8 tile)."""
    with ir.Context() as ctx, ir.Location.unknown():
        transform_ext.load(ctx)
        script = str(GENERIC.script(None, CpuTarget(threads=3, cpu=SSE)))
    filecheck(script, """
        CHECK: transform.named_sequence @fuse
        CHECK: "transform_ext.fuse_roots_into_foralls"(%{{.*}}) {lanes = 4 : i64, min_parallel_work = 4096 : i64, pass_bytes = 16384 : i64, threads = 3 : i64, tile_bytes = 16384 : i64, tiles_per_thread = 4 : i64, vector_tile = 16 : i64}
        CHECK: transform.named_sequence @vectorize
        CHECK: "transform_ext.tile_to_vector_tiles"(%{{.*}}) {k_chunk = 16 : i64, register_tile = [4, 8], vector_tile = 16 : i64}
        CHECK: "transform_ext.tile_insert_slices"(%{{.*}}) {lane_tile = 16 : i64, max_elements = 64 : i64}
    """)


@pytest.mark.parametrize("cpu, register_tile", [(SSE, "4, 8"), (host_cpu(), None)])
def test_the_matmul_script_reads_the_description(cpu, register_tile):
    """The packed panels and register tiles of a matmul: MR x NR = 4 x 8 on 128-bit vectors
    with 16 registers; on this machine what the register tile rule gives its vector unit."""
    if register_tile is None:
        lanes = cpu.f32_lanes
        register_tile = f"{8 if cpu.vector_registers >= 32 else 4}, {2 * lanes}"
    payload = compile_kernel(EXAMPLES / "matmul.py", overrides={"N": 64}, stop_after="cleanup").module
    with payload.context, ir.Location.unknown():
        script = str(MATMUL.script(payload, CpuTarget(threads=2, cpu=cpu)))
    filecheck(script, f"""
        CHECK: transform.named_sequence @pack
        CHECK: transform.structured.pack %{{{{.*}}}} packed_sizes = [{register_tile}, 0]
        CHECK: transform.named_sequence @tile
        CHECK: transform.structured.tile_using_for %{{{{.*}}}} tile_sizes [{register_tile}]
    """)


def test_families_decide_by_description_not_by_name():
    """A CPU vector unit: the family's @vectorize and keys-major attention scores; the XeGPU
    target (no CPU description): neither, and its own attention tiles."""
    cpu = family_params("attention", CpuTarget(threads=2, cpu=SSE))
    assert cpu.vector.vector_tile == 16 and cpu.schedule.key_major
    assert (cpu.schedule.query_tile, cpu.schedule.key_tile) == (None, 64)
    gpu = family_params("attention", XeGpuTarget())
    assert gpu.vector is None and not gpu.schedule.key_major
    assert (gpu.schedule.query_tile, gpu.schedule.key_tile) == XeGpuTarget.attention_tiles
    assert family_params("cross_entropy", XeGpuTarget()).vector is None
    ce = family_params("cross_entropy", CpuTarget(threads=2, cpu=SSE)).schedule
    assert (ce.lanes, ce.min_lanes, ce.vector_tile, ce.block_bytes, ce.sweep_bytes) == \
        (16, 4, 16, 128 << 10, 16 << 10)


def test_options_override_the_description():
    target = CpuTarget(threads=2, cpu=SSE, options=(("key_major", False), ("query_tile", 16),
                                                    ("register_tile", (2, 8)), ("row_tile", 4)))
    params = family_params("attention", target)
    assert (params.schedule.query_tile, params.schedule.key_major) == (16, False)
    assert params.vector.register_tile == (2, 8)
    assert family_params("cross_entropy", target).schedule.row_tile == 4


@pytest.mark.parametrize("options, needles", [
    (dict(query_tyle=32), ["'query_tyle' is not a schedule option", "query_tile"]),
    (dict(query_tile="64"), ["'query_tile' must be int, got '64'"]),
    (dict(query_tile=True), ["'query_tile' must be int, got True"]),
    (dict(return_lse=1), ["'return_lse' must be bool, got 1"]),
    (dict(register_tile=(8,)), ["'register_tile' must be a sequence of 2 ints, got (8,)"]),
    (dict(register_tile=(8, 2.0)), ["'register_tile' must be a sequence of 2 ints"]),
])
def test_a_bad_option_is_a_one_line_error_naming_it(options, needles):
    with pytest.raises(UnsupportedError) as error:
        parse_schedule_options(dict(schedule="attention", **options))
    message = str(error.value)
    assert "\n" not in message and message.startswith("LIGHTHOUSE option ")
    for needle in needles:
        assert needle in message


def test_options_are_parsed_with_lists_as_tuples():
    assert parse_schedule_options(dict(schedule="attention", register_tile=[4, 16], lanes=8)) == \
        dict(register_tile=(4, 16), lanes=8)


def test_an_option_the_parameters_refuse_names_it():
    with pytest.raises(UnsupportedError, match="attention schedule: AttentionParams.query_tile "
                                               "must be >= 1, got 0"):
        family_params("attention", CpuTarget(options=(("query_tile", 0),)))
    with pytest.raises(UnsupportedError, match="CrossEntropyParams.lanes must be >= 1, got 0"):
        family_params("cross_entropy", CpuTarget(options=(("lanes", 0),)))


ODD_OPTION = """
import torch
LIGHTHOUSE = dict(key_tile=[16])
class Model(torch.nn.Module):
    def forward(self, x):
        return x + 1
def get_inputs():
    return [torch.randn(4)]
def get_init_inputs():
    return []
"""


def test_a_kernel_file_with_a_bad_option_fails_before_importing(kernel_file):
    path = kernel_file(ODD_OPTION)
    with pytest.raises(UnsupportedError, match=f"{path}: LIGHTHOUSE option 'key_tile' must be "
                                               r"int, got \[16\]"):
        compile_kernel(path)


def _bug(*args, **kwargs):
    raise NameError("name 'tile' is not defined")


@pytest.mark.parametrize("module, name, kernel, overrides", [
    (schedules.attention.fuse, "plan_attention", "attention.py", ATTENTION),
    (schedules.cross_entropy.plan, "plan_cross_entropy", "cross_entropy.py", dict(N=4, C=40)),
])
def test_a_bug_in_a_check_propagates(monkeypatch, module, name, kernel, overrides):
    """Only a payload the schedule cannot take is a fallback reason: a NameError in the
    check's plan is the error, not a note."""
    monkeypatch.setattr(module, name, _bug)
    with pytest.raises(NameError, match="'tile' is not defined"):
        compile_kernel(EXAMPLES / kernel, overrides=overrides, stop_after="cleanup")


def test_a_bug_in_a_family_check_propagates(monkeypatch):
    monkeypatch.setattr(schedules.attention, "check", _bug)
    with pytest.raises(NameError):
        compile_kernel(EXAMPLES / "attention.py", overrides=ATTENTION, stop_after="cleanup")


def test_lighthouse_cpu_overrides_the_description():
    host = describe_cpu(frozenset({"avx512f"}), {1: 48 << 10, 2: 2 << 20, 3: 480 << 20}, 2)
    narrow = with_overrides(host, "vector_bits=256, vector_registers=16,l1d=32K,l2=1M")
    assert (narrow.f32_lanes, narrow.vector_registers, narrow.l1d_bytes, narrow.l2_bytes,
            narrow.l3_bytes, narrow.threads) == (8, 16, 32 << 10, 1 << 20, 480 << 20, 2)
    assert with_overrides(host, "") == host


@pytest.mark.parametrize("text, needle", [("l2", "'l2' is not one of"),
                                          ("cache=1M", "'cache=1M' is not one of"),
                                          ("l2=lots", "'l2=lots' is not a valid size"),
                                          ("vector_bits=384", "'vector_bits=384' is not a valid")])
def test_a_bad_lighthouse_cpu_is_a_one_line_error(text, needle):
    with pytest.raises(UnsupportedError, match=needle):
        with_overrides(host_cpu(), text)


def test_lighthouse_cpu_reaches_the_schedules():
    """A child process planning for a 256-bit CPU vectorizes in 8-lane tiles."""
    proc = run_cli(EXAMPLES / "softmax.py", "--print-schedule",
                   env={"LIGHTHOUSE_CPU": "vector_bits=256,vector_registers=16"})
    assert proc.returncode == 0, proc.stderr
    filecheck(proc.stdout, "CHECK: vector_tile = 32 : i64")
