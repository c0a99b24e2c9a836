"""Schedules as transform scripts: `--print-schedule` prints the compile's whole script,
`--schedule-file` applies a script instead of the family's, and a printed script replays to
byte-identical IR after every stage and to the same results."""

import re

import pytest
import torch

from lighthouse.compile import compile_kernel
from lighthouse.errors import ScheduleFileError
from lighthouse.families import choose_family
from lighthouse.ingress import import_forward
from lighthouse.kernel import load_kernel
from tests.conftest import EXAMPLES, run_cli
from tests.transform_ext.helpers import check

SMALL = {
    "matmul": {"N": 96},
    "matmul_f16": {},
    "mlp": {"BATCH": 16, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 48},
    "mlp_f16": {"BATCH": 16, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 48},
    "softmax": {"N": 24, "C": 300},
    "log_softmax": {"N": 24, "C": 300},
    "layer_norm": {"N": 24, "D": 200},
    "attention": {"B": 1, "H": 2, "S": 80, "D": 32},
    "attention_causal": {"B": 1, "H": 2, "S": 80, "D": 32, "IS_CAUSAL": True},
    "cross_entropy": {"N": 40, "C": 1000},
    "convolution": {"N": 2, "C": 4, "H": 9, "W": 37, "F": 12, "STRIDE": 2},
    "linear_cross_entropy": {"N": 40, "D": 32, "V": 300},
}


def _example(name: str):
    """The example file of a SMALL entry (`attention_causal`: attention.py, other sizes)."""
    return EXAMPLES / f"{name.split('_causal')[0]}.py"


def _chosen_family(name: str) -> str:
    kernel = load_kernel(_example(name), SMALL[name])
    return choose_family(import_forward(kernel.model, kernel.inputs).module).name


def _replay_cases():
    """Every example with the family chosen for it and with generic and loops forced."""
    return [(name, family) for name in sorted(SMALL)
            for family in sorted({_chosen_family(name), "generic", "loops"})]


def _stage_files(directory):
    return {p.name: p.read_text() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("name, family", _replay_cases())
def test_a_printed_script_replays_to_identical_ir_and_results(tmp_path, name, family):
    path, overrides = _example(name), SMALL[name]
    first = compile_kernel(path, overrides=overrides, schedule=family, strict=True,
                           dump_dir=tmp_path / "built")
    script = tmp_path / "schedule.mlir"
    script.write_text(first.schedule_text())
    second = compile_kernel(path, overrides=overrides, schedule=family, strict=True,
                            dump_dir=tmp_path / "replayed", schedule_file=script)
    built, replayed = _stage_files(tmp_path / "built"), _stage_files(tmp_path / "replayed")
    assert built.keys() == replayed.keys()
    assert any(n.endswith(".transform.mlir") for n in built)
    for stage in built:
        assert built[stage] == replayed[stage], f"{stage} differs after the replay"
    for a, b in zip(first.run(), second.run(), strict=True):
        assert torch.equal(a, b)


XEGPU_CASES = {
    "attention": {"B": 1, "H": 2, "S": 256, "D": 64, "DTYPE": "float16", "IS_CAUSAL": True},
    "mlp_f16": {"BATCH": 64, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 64},
    "matmul_f16": {"M": 64, "N": 128, "K": 96},
    "softmax": {"N": 32, "C": 256},
    "cross_entropy": {"N": 64, "C": 512},
    "log_softmax": {"N": 32, "C": 256},
}
# (matmul and mlp are f32, which DPAS does not take: refused in one line, test_xegpu.py;
# layer_norm's variance accumulates in f64, which the vectorize stage refuses in one line)
# The XeGPU stages applied from the script, with the symbols of their sequences.
XEGPU_SCHEDULE_STAGES = {"fuse": "fuse", "workgroups": "workgroups", "subgroups": "subgroups",
                         "vectorize": "vectorize", "bufferize": "bufferize",
                         "gpu-outline": "gpu_outline", "xegpu": "xegpu",
                         "xegpu-layouts": "xegpu_layouts"}


def _without_counters(text: str) -> str:
    """The lowerings number their string globals (.str.cachecontrol.N, .str.file.N,
    assert_msg_N) by process-wide counters (upstream): a second compile in one process
    counts on, and the SPIR-V words spelling those names follow (the binary translates the
    xevm stage, compared as text)."""
    return re.sub(r'bin = "[^"]*"', "bin", re.sub(r"(\.str\.\w+\.|assert_msg_)\d+", r"\1", text))


def _dumped(directory, stage: str, suffix: str = ".mlir"):
    (path,) = [p for p in directory.iterdir() if re.fullmatch(rf"\d\d-{stage}{re.escape(suffix)}", p.name)]
    return path


@pytest.mark.parametrize("name", sorted(XEGPU_CASES))
def test_a_printed_xegpu_script_replays_to_identical_ir(tmp_path, name):
    """On the XeGPU target every schedule stage (the family's @fuse or the GPU preparation,
    then the XeGPU stages) is a sequence of the printed script, dumped beside its IR; the
    script replays to byte-identical IR after every stage, down to the SPIR-V kernels."""
    path, overrides = EXAMPLES / f"{name}.py", XEGPU_CASES[name]
    first = compile_kernel(path, overrides=overrides, target="xegpu", dump_dir=tmp_path / "built")
    script = tmp_path / "schedule.mlir"
    script.write_text(first.schedule_text())
    compile_kernel(path, overrides=overrides, target="xegpu", dump_dir=tmp_path / "replayed",
                   schedule_file=script)
    built, replayed = _stage_files(tmp_path / "built"), _stage_files(tmp_path / "replayed")
    assert built.keys() == replayed.keys()
    for stage, symbol in XEGPU_SCHEDULE_STAGES.items():
        text = built[_dumped(tmp_path / "built", stage, ".transform.mlir").name]
        assert f"transform.named_sequence @{symbol}(" in text, stage
    assert any(n.endswith("binary.mlir") for n in built)
    for stage in built:
        assert _without_counters(built[stage]) == _without_counters(replayed[stage]), \
            f"{stage} differs after the replay"


@pytest.mark.parametrize("name", ["softmax", "cross_entropy"])
def test_an_xegpu_stage_reruns_from_the_dump_of_the_one_before(tmp_path, name):
    """Each XeGPU schedule stage's sequence of the printed script, applied in a fresh
    context to the dumped IR of the stage before, gives that stage's dumped IR: what a stage
    needs from earlier ones is in the IR (or written in the script), not in the compiler."""
    from torch_mlir import ir

    import transform_ext
    from schedules.script import apply_stage

    path, overrides = EXAMPLES / f"{name}.py", XEGPU_CASES[name]
    compiled = compile_kernel(path, overrides=overrides, target="xegpu", dump_dir=tmp_path)
    text = compiled.schedule_text()
    names = list(XEGPU_SCHEDULE_STAGES)
    for before, stage in zip(names, names[1:]):
        ctx = ir.Context()
        transform_ext.load(ctx)
        with ctx, ir.Location.unknown():
            script = ir.Module.parse(text)
            payload = ir.Module.parse(_dumped(tmp_path, before).read_text())
            apply_stage(payload, script, XEGPU_SCHEDULE_STAGES[stage])
        # (vectorize: the stage expands math.erf after the script's @vectorize; none here)
        assert str(payload) == _dumped(tmp_path, stage).read_text(), f"{stage} rerun differs"


def test_print_schedule_on_xegpu_prints_every_stage_in_order():
    """The XeGPU script: @fuse, the recorded steps with their decisions (tile sizes, the
    subgroup layout, thread counts, the chip, the kernel metadata, prefetch layouts), then
    one sequence per XeGPU schedule stage including its steps in order."""
    proc = run_cli(EXAMPLES / "softmax.py", "--target", "xegpu", "--print-schedule")
    assert proc.returncode == 0, proc.stderr
    check(proc.stdout, """
        CHECK: module attributes {transform.with_named_sequence}
        CHECK: transform.named_sequence @fuse(
        CHECK: transform.named_sequence @constants_to_arguments(
        CHECK: "transform_ext.constants_to_arguments"
        CHECK: transform.named_sequence @tile_row_kernel(
        CHECK: tile_using_forall %{{.*}} tile_sizes [8, 0](mapping = [#gpu.block<x>])
        CHECK: transform.named_sequence @subgroup_layouts(
        CHECK-DAG: transform.param.constant array<i64: 4, 1>
        CHECK-DAG: transform.annotate %{{.*}} "xegpu.sg_layout"
        CHECK-DAG: transform.annotate %{{.*}} "xegpu.threads"
        CHECK: transform.named_sequence @vectorize_tiles(
        CHECK: transform.named_sequence @one_shot_bufferize(
        CHECK: transform.named_sequence @set_launch_threads(
        CHECK: transform.xegpu.set_gpu_launch_threads %{{.*}} threads = [64, 1, 1]
        CHECK: transform.named_sequence @outline_kernels(
        CHECK: transform.apply_registered_pass "xevm-attach-target" with options = {"O" = 3 : i64, "chip" = "bmg"}
        CHECK: transform.named_sequence @launch_metadata(
        CHECK: transform.param.constant {description = {{.*}}, grid = array<i64: 32, 1, 1>, kind = "rows", threads = 64 : i64}
        CHECK: transform.annotate %{{.*}} "lh.kernel"
        CHECK: transform.named_sequence @convert_vector_to_xegpu(
        CHECK: transform.named_sequence @anchor_layouts(
        CHECK: transform.xegpu.set_anchor_layout
        CHECK: transform.named_sequence @workgroups(
        CHECK-NEXT: transform.include @constants_to_arguments
        CHECK-NEXT: transform.include @tile_row_kernel
        CHECK: transform.named_sequence @subgroups(
        CHECK-NEXT: transform.include @subgroup_layouts
        CHECK: transform.named_sequence @vectorize(
        CHECK-NEXT: transform.include @vectorize_tiles
        CHECK: transform.named_sequence @bufferize(
        CHECK-NEXT: transform.include @one_shot_bufferize
        CHECK: transform.named_sequence @gpu_outline(
        CHECK-NEXT: transform.include @foralls_to_parallel
        CHECK: transform.named_sequence @xegpu(
        CHECK-NEXT: transform.include @convert_vector_to_xegpu
        CHECK: transform.named_sequence @xegpu_layouts(
        CHECK: transform.include @anchor_layouts
    """)


def test_print_schedule_prints_every_stage_and_exits_0(tmp_path):
    proc = run_cli(EXAMPLES / "softmax.py", "--schedule", "loops", "--print-schedule")
    assert proc.returncode == 0, proc.stderr
    check(proc.stdout, """
        CHECK: module attributes {transform.with_named_sequence}
        CHECK: transform.named_sequence @fuse(%{{.*}}: !transform.any_op {transform.consumed})
        CHECK: transform.named_sequence @vectorize(
    """)


def test_the_attention_script_reads_as_the_algorithm():
    """--print-schedule of causal attention: normalization, query-block tiling, the online
    softmax over key tiles, the causal bounds, then vectorization, each a named step."""
    proc = run_cli(EXAMPLES / "attention.py", "--set", "S=128", "--set", "IS_CAUSAL=True",
                   "--print-schedule")
    assert proc.returncode == 0, proc.stderr
    check(proc.stdout, """
        CHECK: transform.named_sequence @normalize(
        CHECK: transform.include @fold_constants_and_reshapes
        CHECK: transform.include @sink_normalization
        CHECK: transform.include @guard_from_row_max
        CHECK: transform.named_sequence @tile_query_blocks(
        CHECK: tile_using_forall %{{.*}} tile_sizes [1, 64, 0]
        CHECK: transform.named_sequence @online_softmax(
        CHECK: "transform_ext.fuse_key_loops"(%{{.*}}) {key_tile = 64 : i64}
        CHECK: transform.named_sequence @causal_bounds(
        CHECK: "transform_ext.bound_causal_key_loops"(%{{.*}}) {delta = 0 : i64, query_iv = 1 : i64, query_tile = 64 : i64, split = true}
        CHECK: transform.named_sequence @fuse(
        CHECK-NEXT: transform.include @normalize
        CHECK-NEXT: transform.include @tile_query_blocks
        CHECK-NEXT: transform.include @online_softmax
        CHECK-NEXT: transform.include @causal_bounds
        CHECK: transform.named_sequence @vectorize(
        CHECK: "transform_ext.pack_key_tiles"
        CHECK: transform.structured.vectorize_children_and_apply_patterns
        CHECK: transform.loop.unroll %{{.*}} {factor = 4 : i64}
    """)


def test_an_edited_attention_tile_replays_to_torch(tmp_path):
    """The query tile edited in the printed attention script: the query blocks have the
    new size and the causal bounds still give torch's result."""
    args = ("--set", "S=128", "--set", "IS_CAUSAL=True")
    text = run_cli(EXAMPLES / "attention.py", *args, "--print-schedule").stdout
    assert "tile_sizes [1, 64, 0]" in text and "query_tile = 64" in text
    script = tmp_path / "edited.mlir"
    script.write_text(text.replace("tile_sizes [1, 64, 0]", "tile_sizes [1, 16, 0]")
                      .replace("query_tile = 64", "query_tile = 16"))
    compiled = compile_kernel(EXAMPLES / "attention.py", overrides={"S": 128, "IS_CAUSAL": True},
                              schedule_file=script, dump_dir=tmp_path / "dump")
    check((tmp_path / "dump" / "03-fuse.mlir").read_text(), """
        CHECK: scf.forall (%{{.*}}, %{{.*}}) in (4, 8)
    """)
    for report in compiled.check():
        assert report.ok, str(report)


def test_an_attention_tile_edited_without_its_causal_bound_is_refused(tmp_path):
    """The query tile changed in tile_using_forall but not in bound_causal_key_loops: the
    bound would skip keys the rows need; the compile stops naming the op and the mismatch."""
    args = ("--set", "S=128", "--set", "IS_CAUSAL=True")
    text = run_cli(EXAMPLES / "attention.py", *args, "--print-schedule").stdout
    script = tmp_path / "edited.mlir"
    script.write_text(text.replace("tile_sizes [1, 64, 0]", "tile_sizes [1, 16, 0]"))
    line = next(i for i, l in enumerate(text.splitlines(), 1) if "bound_causal_key_loops" in l)
    proc = run_cli(EXAMPLES / "attention.py", *args, "--schedule-file", script, "--check")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"error: {script}:{line}:5: transform_ext.bound_causal_key_loops failed: scf.forall: "
        f"induction variable 1 does not index blocks of 64 query rows (its result offsets step "
        f"by 16)")


def test_the_cross_entropy_script_reads_as_the_algorithm():
    proc = run_cli(EXAMPLES / "cross_entropy.py", "--set", "N=40", "--set", "C=1000",
                   "--print-schedule")
    assert proc.returncode == 0, proc.stderr
    check(proc.stdout, """
        CHECK: transform.named_sequence @normalize(
        CHECK: transform.named_sequence @restructure(
        CHECK: "transform_ext.split_class_reductions"
        CHECK: transform.named_sequence @name_target_checks(
        CHECK: transform.named_sequence @mark_class_sums(
        CHECK: transform.named_sequence @tile_rows(
        CHECK: tile_using_forall %{{.*}} tile_sizes [5]
        CHECK: transform.named_sequence @fuse_class_loops(
        CHECK: "transform_ext.fuse_dependent_reduction_ops"(%{{.*}}, %{{.*}}) {{{.*}}tile_size = 960 : i64, yield_producers = false}
        CHECK: transform.named_sequence @fuse(
        CHECK-NEXT: transform.include @normalize
        CHECK-NEXT: transform.include @restructure
        CHECK-NEXT: transform.include @name_target_checks
        CHECK-NEXT: transform.include @mark_class_sums
        CHECK-NEXT: transform.include @sink_root_readers
        CHECK-NEXT: transform.include @tile_rows
        CHECK-NEXT: transform.include @fuse_class_loops
        CHECK: transform.named_sequence @vectorize(
        CHECK-NEXT: transform.include @tile_class_sums
        CHECK: transform.structured.vectorize_children_and_apply_patterns
    """)
    tile_class_sums = proc.stdout.split("@tile_class_sums(")[1].split("transform.named_sequence")[0]
    check(tile_class_sums, """
        CHECK: "transform_ext.inline_elementwise_producers"
        CHECK: transform.structured.tile_reduction_using_for
        CHECK: "transform_ext.expand_fast_exp"
        CHECK: "transform_ext.remove_annotation"
    """)


@pytest.mark.parametrize("backward", [False, True])
def test_an_edited_class_tile_replays_to_torch(tmp_path, backward):
    """The fused class loop's tile edited in the printed cross-entropy script: the loop
    steps by it (with a remainder tile) and the loss and gradient stay torch's."""
    args = ("--set", "N=40", "--set", "C=1000") + (("--backward",) if backward else ())
    text = run_cli(EXAMPLES / "cross_entropy.py", *args, "--print-schedule").stdout
    assert "tile_size = 960 : i64" in text
    script = tmp_path / "edited.mlir"
    script.write_text(text.replace("tile_size = 960 : i64", "tile_size = 96 : i64"))
    compiled = compile_kernel(EXAMPLES / "cross_entropy.py", overrides={"N": 40, "C": 1000},
                              backward=backward, schedule_file=script, dump_dir=tmp_path / "dump")
    check((tmp_path / "dump" / "03-fuse.mlir").read_text(), """
        CHECK: %[[STEP:.*]] = arith.constant 96 : index
        CHECK: scf.for %{{.*}} = %{{.*}} to %{{.*}} step %[[STEP]]
    """)
    for report in compiled.check():
        assert report.ok, str(report)


MATMUL_TILES = """
module attributes {transform.with_named_sequence} {
  transform.named_sequence @fuse(%root: !transform.any_op {transform.consumed}) {
    %mm = transform.structured.match ops{["linalg.matmul"]} in %root
      : (!transform.any_op) -> !transform.any_op
    %tiled, %loop = transform.structured.tile_using_for %mm tile_sizes [TILE]
      : (!transform.any_op) -> (!transform.any_op, !transform.any_op)
    transform.yield
  }
  transform.named_sequence @vectorize(%root: !transform.any_op {transform.consumed}) {
    transform.yield
  }
}
"""


@pytest.mark.parametrize("tile", [8, 24])
def test_an_edited_script_changes_the_schedule(tmp_path, tile):
    """A user's script replaces the family's: the tile size written in it is the step of the
    loop it produces, and the kernel still matches torch."""
    script = tmp_path / "tiles.mlir"
    script.write_text(MATMUL_TILES.replace("TILE", str(tile)))
    compiled = compile_kernel(EXAMPLES / "matmul.py", overrides={"N": 96}, schedule_file=script,
                              dump_dir=tmp_path / "dump")
    check((tmp_path / "dump" / "03-fuse.mlir").read_text(), f"""
        CHECK: %[[STEP:.*]] = arith.constant {tile} : index
        CHECK: scf.for %{{{{.*}}}} = %{{{{.*}}}} to %{{{{.*}}}} step %[[STEP]]
        CHECK: linalg.matmul {{{{.*}}}} tensor<{tile}x96xf32>
    """)
    check((tmp_path / "dump" / "03-fuse.transform.mlir").read_text(), f"""
        CHECK: transform.named_sequence @fuse
        CHECK: tile_using_for %{{{{.*}}}} tile_sizes [{tile}]
    """)
    for report in compiled.check():
        assert report.ok, str(report)


def _cli_error(tmp_path, text, *extra):
    script = tmp_path / "bad.mlir"
    if text is not None:
        script.write_text(text)
    proc = run_cli(EXAMPLES / "matmul.py", "--set", "N=32", "--schedule-file", script, *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0], script


def test_a_failing_transform_op_is_named_with_its_location(tmp_path):
    line, script = _cli_error(tmp_path, MATMUL_TILES.replace("TILE", "0, 0, 0, 8"), "--check")
    assert line == (f"error: {script}:6:21: transform.structured.tile_using_for failed: "
                    f"too many tiles provided, expected at most 3 found 4")


@pytest.mark.parametrize("text, expected", [
    (None, "cannot read the schedule file"),
    ("module {\n  func.func @f( {\n}\n", "bad.mlir:2:"),
    ("module {\n}\n", "not a schedule script"),
    (MATMUL_TILES.replace("TILE", "8").split("  transform.named_sequence @vectorize")[0] + "}\n",
     "has no named sequence @vectorize (it has: @fuse)"),
    (MATMUL_TILES.replace("TILE", "8, 8"), "bad.mlir:6:21: 'transform.structured.tile_using_for' "
     "op expected number of loops to tile (2) to match number of `loops` results (1)"),
])
def test_a_bad_schedule_file_is_a_one_line_error(tmp_path, text, expected):
    line, _ = _cli_error(tmp_path, text)
    assert expected in line, line


def test_a_failing_schedule_file_never_falls_back(tmp_path):
    script = tmp_path / "bad.mlir"
    script.write_text(MATMUL_TILES.replace("TILE", "0, 0, 0, 8"))
    with pytest.raises(ScheduleFileError, match="tile_using_for failed"):
        compile_kernel(EXAMPLES / "matmul.py", overrides={"N": 32}, schedule_file=script)
