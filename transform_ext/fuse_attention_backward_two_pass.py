"""fuse_attention_backward_two_pass: the attention backward (FlashAttention-2) as two
parallel passes, a query-block pass computing dQ and a key-block pass computing dK and dV.

For the attention backward of each target function (transform_ext/analysis/
attention_backward.py: dQ, dK, dV from Q, K, V, O, dO with scale c), with `dq_tiles` =
[bq, bk] and `dkv_tiles` = [bk2, bq2]:

  pass 1, an scf.forall over (groups G, query blocks of bq rows), per block i:
    D_i = rowsum(dO_i * O_i)
    lse_i = the forward's (given), else a first loop over key tiles of bk: the online max m
            and sum l, lse = m + log l (-inf on a fully masked row)
    for each key tile j: S = c Q_i K_j^T,  P = exp(S - lse_i) (0 where lse_i = -inf),
                         dP = dO_i V_j^T,  dS = P (dP - D_i),  dQ_i += dS K_j
    dQ_i *= c; dQ_i, D_i and the computed lse_i are written
  pass 2, an scf.forall over (K/V groups, key blocks of bk2 keys), per block j, for each
  query head of the group and each query tile i of bq2 rows:
    S^T = c K_j Q_i^T,  P^T = exp(S^T - lse_i),  dV_j += P^T dO_i,
    dP^T = V_j dO_i^T,  dS^T = P^T (dP^T - D_i),  dK_j += dS^T Q_i
    dK_j *= c; dK_j and dV_j are written

Every contraction of a pass reduces over what one forall iteration owns whole (the keys of
a key tile for dQ, the queries of a query tile for dK and dV): the iterations share nothing
but the rows' lse and D, which pass 1 writes and pass 2 reads. That is the form a GPU wants
(one workgroup per iteration, its subgroups splitting the block's rows, no reduction across
them); it recomputes S and P in both passes (8 or, computing lse, 9 tile products against
the one-pass kernel's 5 or 6: transform_ext/fuse_attention_backward.py, the CPU's form).
No L x S tensor exists. A causal mask (every masked-in score has key <= query + delta)
bounds both passes: pass 1's key loops stop at the first tile wholly right of the diagonal,
pass 2's query loop starts at the first tile not wholly above it, and the tiles crossing it
are masked by index. An additive mask (analysis.attention_backward.Bias) is read per tile
in place, transposed in pass 2. The inputs are read through copies of their elementwise
producers (type extensions), so the kernel shares no value with a forward computed beside
it (and an f32 splat constant exactly representable in Q's f16/bf16, the ones --backward
seeds dO with, is read in that type); a gradient whose only reader rounds it (an elementwise arith.truncf to f16/bf16) is
written rounded by the kernel, which replaces that reader. The kernel is a private function
the target function calls (inline it and canonicalize after this op); its foralls carry
FUSED_KERNEL and, as an integer attribute BACKWARD_PASS, their pass (1 or 2).

Preconditions (checked first; a violation is a silenceable failure naming the op): those of
fuse_attention_backward (one attention backward, static f32 tensors, K and V with the
queries' groups, one head dim, an index-computed mask iff `causal_delta` >= 0 is given,
the gradients' users after their sources), no mask that needs a gradient, an O to read
(D = rowsum(dO O), not rowsum(P dP) alone), and every tile
dividing its extent: bq and bq2 dividing L, bk and bk2 dividing S.
"""

import dataclasses
import math
import struct

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, func, tensor, transform

from .analysis.attention_backward import AttentionBackward
from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, build_generic,
                     clone_body, clone_op, constant_value, defining_op, fail, iterator_kinds,
                     ops_named, payload_ops, users)
from .dialect import TransformExt
from .fuse_attention_backward import (FUSED_KERNEL, _canonical, _canonical_rows, _forward_lse,
                                      _reshape, _shape, plan, rescaled_rows, summed_rows)

NAME = "transform_ext.fuse_attention_backward_two_pass"
# the integer attribute naming the pass (1: dQ over query blocks, 2: dK, dV over key blocks)
BACKWARD_PASS = "lh.backward_pass"
# marks, while the kernel is built, the conversion of a bias tile as stored to f32
BIAS_TILE = "lh.bias_tile"
NARROW = ("f16", "bf16")


def _t(*dims, element: str = "f32") -> str:
    return "tensor<" + "".join(f"{d}x" for d in dims) + f"{element}>"


_ID2 = "affine_map<(a, b) -> (a, b)>"
_ROW = "affine_map<(a, b) -> (a)>"
_COL = "affine_map<(a, b) -> (b)>"
_ID1 = "affine_map<(a) -> (a)>"
_PARALLEL2 = '["parallel", "parallel"]'


def _contraction(name: str, a: str, a_type: str, b: str, b_type: str, acc: str, acc_type: str,
                 a_map: str = "(m, k)") -> str:
    """`name` = acc + A B over k, C[m, n]; A indexed `a_map`, B (k, n)."""
    return f"""
        %{name} = linalg.generic {{indexing_maps = [affine_map<(m, n, k) -> {a_map}>, affine_map<(m, n, k) -> (k, n)>, affine_map<(m, n, k) -> (m, n)>], iterator_types = ["parallel", "parallel", "reduction"]}} ins({a}, {b} : {a_type}, {b_type}) outs({acc} : {acc_type}) {{
        ^bb0(%x: f32, %y: f32, %acc: f32):
          %p = arith.mulf %x, %y : f32
          %s = arith.addf %acc, %p : f32
          linalg.yield %s : f32
        }} -> {acc_type}"""


def _scaled(name: str, src: str, src_type: str, out: str, out_type: str, element: str,
            factor: str = "%scale") -> str:
    """`name` = src * factor (None: src), rounded to `element` unless f32."""
    ops = [f"%m = arith.mulf %x, {factor} : f32"] if factor else []
    value = "%m" if factor else "%x"
    if element != "f32":
        ops.append(f"%r = arith.truncf {value} : f32 to {element}")
        value = "%r"
    body = "".join(f"\n        {op}" for op in ops)
    return f"""
      %{name} = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({src} : {src_type}) outs({out} : {out_type}) {{
      ^bb0(%x: f32, %y: {element}):{body}
        linalg.yield {value} : {element}
      }} -> {out_type}"""


class _Tile:
    """The score tiles of one pass: [rows, cols] with rows the queries (pass 1) or the keys
    (pass 2); `query`, `key`: the SSA names of the tile's first query and key; the masks
    read per tile."""

    def __init__(self, rows: int, cols: int, keys_major: bool, delta: int | None, bias):
        self.rows, self.cols, self.keys_major = rows, cols, keys_major
        self.delta, self.bias = delta, bias
        self.type = _t(rows, cols)

    def mask(self, src: str, dst: str, empty: str, causal: bool = True) -> tuple[str, str]:
        """(the masked tile's name, its ops): `src` plus the bias, or, `causal` (a tile the
        diagonal crosses), with -inf where the causal mask removes a score."""
        if self.bias is not None:
            return f"%{dst}", self._bias(src, dst, empty)
        if self.delta is None or not causal:
            return src, ""
        rows, cols = ("%kpos", "%qpos") if self.keys_major else ("%qpos", "%kpos")
        row0, col0 = ("%j0", "%i0") if self.keys_major else ("%i0", "%j0")
        return f"%{dst}", f"""
        %{dst} = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({src} : {self.type}) outs({empty} : {self.type}) {{
        ^bb0(%s: f32, %unused: f32):
          %ia = linalg.index 0 : index
          %ib = linalg.index 1 : index
          {rows} = arith.addi %ia, {row0} : index
          {cols} = arith.addi %ib, {col0} : index
          %qd = arith.addi %qpos, %cdelta : index
          %ok = arith.cmpi ule, %kpos, %qd : index
          %r = arith.select %ok, %s, %ninf : f32
          linalg.yield %r : f32
        }} -> {self.type}"""

    def _bias(self, src: str, dst: str, empty: str) -> str:
        shape, roles, _, element = self.bias
        where = {"g": "%g", "b": "%gb", "h": "%gh", "q": "%i0", "k": "%j0", "1": "0"}
        queries, keys = (self.cols, self.rows) if self.keys_major else (self.rows, self.cols)
        size = {"q": queries, "k": keys}
        kept = [r for r in roles if r in "qk"]
        dim_of = ({"q": "b", "k": "a"} if self.keys_major else {"q": "a", "k": "b"})
        tile_shape = [size[r] for r in kept]
        tile = _t(*tile_shape)
        tile_map = "affine_map<(a, b) -> (" + ", ".join(dim_of[r] for r in kept) + ")>"
        read = f"""
        %{dst}_b = tensor.extract_slice %bias[{", ".join(where[r] for r in roles)}] [{", ".join(str(size.get(r, 1)) for r in roles)}] [{", ".join("1" for _ in roles)}] : {_t(*shape, element=element)} to {_t(*tile_shape, element=element)}"""
        if element != "f32":
            # the bias as stored; rewrite() replaces this conversion by the ops computing
            # the f32 bias from it (BIAS_TILE)
            dims = "abc"[:len(tile_shape)]
            same = f"affine_map<({', '.join(dims)}) -> ({', '.join(dims)})>"
            convert = "arith.uitofp" if element.startswith("i") else "arith.extf"
            read = read.replace(f"%{dst}_b = ", f"%{dst}_s = ") + f"""
        %{dst}_e = tensor.empty() : {tile}
        %{dst}_b = linalg.generic {{indexing_maps = [{same}, {same}], iterator_types = [{", ".join(['"parallel"'] * len(dims))}]}} ins(%{dst}_s : {_t(*tile_shape, element=element)}) outs(%{dst}_e : {tile}) attrs = {{{BIAS_TILE}}} {{
        ^bb0(%x: {element}, %y: f32):
          %w = {convert} %x : {element} to f32
          linalg.yield %w : f32
        }} -> {tile}"""
        return read + f"""
        %{dst} = linalg.generic {{indexing_maps = [{_ID2}, {tile_map}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({src}, %{dst}_b : {self.type}, {tile}) outs({empty} : {self.type}) {{
        ^bb0(%s: f32, %bv: f32, %unused: f32):
          %r = arith.addf %s, %bv : f32
          linalg.yield %r : f32
        }} -> {self.type}"""

    def probabilities(self, name: str, scores: str, lse: str, empty: str) -> str:
        """P = exp(S - lse), 0 where lse = -inf (lse per query: per row, or per column when
        the keys are the rows)."""
        lse_map = _COL if self.keys_major else _ROW
        lse_type = _t(self.cols if self.keys_major else self.rows)
        return f"""
        %{name} = linalg.generic {{indexing_maps = [{_ID2}, {lse_map}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({scores}, {lse} : {self.type}, {lse_type}) outs({empty} : {self.type}) {{
        ^bb0(%x: f32, %ls: f32, %y: f32):
          %isinf = arith.cmpf oeq, %ls, %ninf : f32
          %d = arith.subf %x, %ls : f32
          %ex = math.exp %d : f32
          %r = arith.select %isinf, %zero, %ex : f32
          linalg.yield %r : f32
        }} -> {self.type}"""

    def score_gradient(self, name: str, p: str, dp: str, d: str, empty: str) -> str:
        """dS = P (dP - D), D per query."""
        d_map = _COL if self.keys_major else _ROW
        d_type = _t(self.cols if self.keys_major else self.rows)
        return f"""
        %{name} = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}, {d_map}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({p}, {dp}, {d} : {self.type}, {self.type}, {d_type}) outs({empty} : {self.type}) {{
        ^bb0(%pp: f32, %dpp: f32, %dd: f32, %y: f32):
          %df = arith.subf %dpp, %dd : f32
          %r = arith.mulf %pp, %df : f32
          linalg.yield %r : f32
        }} -> {self.type}"""


def _read(name: str, tensor: str, tensor_shape, element: str, offsets: str,
          shape: tuple[int, ...], indent: str = "        ") -> str:
    """%name = the [shape] tile of `tensor` at `offsets` (unit dims dropped), widened to
    f32 when `element` is narrower (%name_n the tile as stored)."""
    ones = ", ".join("1" for _ in tensor_shape)
    sizes = ", ".join(str(d) for d in _sizes(tensor_shape, shape))
    stored = _t(*shape, element=element)
    if element == "f32":
        return f"""
{indent}%{name} = tensor.extract_slice {tensor}[{offsets}] [{sizes}] [{ones}] : {_t(*tensor_shape, element=element)} to {stored}"""
    wide = _t(*shape)
    maps = ", ".join([f"affine_map<({', '.join('abc'[:len(shape)])}) -> ({', '.join('abc'[:len(shape)])})>"] * 2)
    parallel = ", ".join(['"parallel"'] * len(shape))
    return f"""
{indent}%{name}_n = tensor.extract_slice {tensor}[{offsets}] [{sizes}] [{ones}] : {_t(*tensor_shape, element=element)} to {stored}
{indent}%{name}_e = tensor.empty() : {wide}
{indent}%{name} = linalg.generic {{indexing_maps = [{maps}], iterator_types = [{parallel}]}} ins(%{name}_n : {stored}) outs(%{name}_e : {wide}) {{
{indent}^bb0(%x: {element}, %y: f32):
{indent}  %w = arith.extf %x : {element} to f32
{indent}  linalg.yield %w : f32
{indent}}} -> {wide}"""


def _sizes(tensor_shape, shape) -> list[int]:
    """The slice sizes of a `shape` tile of a [groups, ...] tensor: 1 for the group."""
    return [1] * (len(tensor_shape) - len(shape)) + list(shape)


def _lse_loop(tile: _Tile, E: int, Gk: int, S: int, name: str, bounds: tuple[str, str],
              inits: tuple[str, str], causal: bool, k_element: str) -> str:
    """One of pass 1's first key loops, over the key tiles in `bounds`: %name:2, the rows'
    online max m and sum l continued from `inits`."""
    bq, bk = tile.rows, tile.cols
    rows = _t(bq)
    masked, mask_ops = tile.mask("%s_raw", "s_m", "%e_qk", causal)
    return f"""
      %{name}:2 = scf.for %j0 = {bounds[0]} to {bounds[1]} step %cbk iter_args(%m = {inits[0]}, %l = {inits[1]}) -> ({rows}, {rows}) {{{_read("kT_l", "%kT", (Gk, E, S), k_element, "%gk, 0, %j0", (E, bk))}{_contraction("s_raw", "%qc", _t(bq, E), "%kT_l", _t(E, bk), "%z_qk", tile.type)}{mask_ops}
        %mt = linalg.generic {{indexing_maps = [{_ID2}, {_ROW}], iterator_types = ["parallel", "reduction"]}} ins({masked} : {tile.type}) outs(%m : {rows}) {{
        ^bb0(%x: f32, %acc: f32):
          %mx = arith.maximumf %x, %acc : f32
          linalg.yield %mx : f32
        }} -> {rows}{rescaled_rows("corr", "%l", rows, "%l")}{summed_rows("ln", masked, tile.type, "%corr", rows)}
        scf.yield %mt, %ln : {rows}, {rows}
      }}"""


def _lse(tile: _Tile, E: int, Gk: int, S: int, loops: list, k_element: str) -> str:
    """Pass 1's first key loops (`loops`: (bounds, causal) each, in order): %lse, the rows'
    m + log l (-inf on fully masked rows)."""
    rows = _t(tile.rows)
    text = f"""
      %m_init = linalg.fill ins(%ninf : f32) outs(%e_q : {rows}) -> {rows}"""
    inits = ("%m_init", "%z_q")
    for i, (bounds, causal) in enumerate(loops):
        text += _lse_loop(tile, E, Gk, S, f"ml{i}", bounds, inits, causal, k_element)
        inits = (f"%ml{i}#0", f"%ml{i}#1")
    return text + f"""
      %lse = linalg.generic {{indexing_maps = [{_ID1}, {_ID1}, {_ID1}], iterator_types = ["parallel"]}} ins({inits[0]}, {inits[1]} : {rows}, {rows}) outs(%e_q : {rows}) {{
      ^bb0(%mx: f32, %lx: f32, %y: f32):
        %lg = math.log %lx : f32
        %s = arith.addf %mx, %lg : f32
        %isinf = arith.cmpf oeq, %mx, %ninf : f32
        %r = arith.select %isinf, %ninf, %s : f32
        linalg.yield %r : f32
      }} -> {rows}"""


# per-row values cross from pass 1 to pass 2 in lane form, [G, L, LANES], each row's value in
# every lane: how a GPU subgroup holds a row's value after a reduction (XeGPU has no layout
# for a vector of rows spread over the lanes), written by a 2-D block store
LANES = 16


def _signed(value: int) -> str:
    """` + value` or ` - |value|` (an affine expression's constant term)."""
    return f" + {value}" if value >= 0 else f" - {-value}"


def _lanes(name: str, rows: str, count: int) -> str:
    """%name = the [count] vector `rows` in lane form [count, LANES]."""
    return f"""
      %{name}_e = tensor.empty() : {_t(count, LANES)}
      %{name} = linalg.generic {{indexing_maps = [{_ROW}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({rows} : {_t(count)}) outs(%{name}_e : {_t(count, LANES)}) {{
      ^bb0(%x: f32, %y: f32):
        linalg.yield %x : f32
      }} -> {_t(count, LANES)}"""


def _from_lanes(name: str, lanes: str, G: int, L: int, count: int) -> str:
    """%name = the [count] per-row vector at rows %i0.. of group %g of the lane-form tensor
    `lanes`, read as [LANES / 2, count] (its copies transposed: the rows along the GPU
    lanes) and reduced by max over the identical copies (exact)."""
    copies = LANES // 2
    return f"""
        %{name}_t = tensor.extract_slice {lanes}[%g, %i0, 0] [1, {count}, {copies}] [1, 1, 1] : {_t(G, L, LANES)} to {_t(count, copies)}
        %{name}_e = tensor.empty() : {_t(count)}
        %{name}_z = linalg.fill ins(%ninf : f32) outs(%{name}_e : {_t(count)}) -> {_t(count)}
        %{name} = linalg.generic {{indexing_maps = [affine_map<(a, b) -> (b, a)>, {_COL}], iterator_types = ["reduction", "parallel"]}} ins(%{name}_t : {_t(count, copies)}) outs(%{name}_z : {_t(count)}) {{
        ^bb0(%x: f32, %acc: f32):
          %mx = arith.maximumf %x, %acc : f32
          linalg.yield %mx : f32
        }} -> {_t(count)}"""


def _scaled_input(name: str, src: str, shape: tuple[int, int], element: str) -> str:
    """%name = c * src, f32 (src widened first when narrower)."""
    widen = (f"\n      %w = arith.extf %x : {element} to f32" if element != "f32" else "")
    value = "%w" if element != "f32" else "%x"
    return f"""
      %{name}_e = tensor.empty() : {_t(*shape)}
      %{name} = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}], iterator_types = {_PARALLEL2}}} ins({src} : {_t(*shape, element=element)}) outs(%{name}_e : {_t(*shape)}) {{
      ^bb0(%x: {element}, %y: f32):{widen}
        %m = arith.mulf {value}, %scale : f32
        linalg.yield %m : f32
      }} -> {_t(*shape)}"""


def two_pass_text(name: str, G: int, L: int, S: int, E: int, dq_tiles: tuple[int, int],
                  dkv_tiles: tuple[int, int], scale: float, delta: int | None,
                  bias: tuple | None = None, lse_given: bool = False, grp: int = 1,
                  inputs: tuple[str, ...] = ("f32",) * 5,
                  outputs: tuple[str, ...] = ("f32",) * 3) -> str:
    """The kernel as MLIR text: func.func private @name(q, k, v, o, dO[, bias][, lse]) ->
    (dQ, dK, dV); `inputs`, `outputs`: the element types of q, k, v, o, dO and of dQ, dK,
    dV (tiles are widened to f32 as they are read, gradients rounded as they are written);
    `bias`: (its shape, its dims' roles, heads, its element type), see
    analysis.attention_backward.Bias (read as stored, widened by a conversion marked
    BIAS_TILE when not f32);
    `lse_given`: the rows' lse [G, L] is an argument, else pass 1 computes it; `grp`: query
    heads per K/V head (K, V, dK, dV have G / grp groups; query group g reads K/V group
    g // grp)."""
    Gk = G // grp
    bq, bk = dq_tiles
    bk2, bq2 = dkv_tiles
    causal = delta is not None
    tile1 = _Tile(bq, bk, False, delta, bias)
    tile2 = _Tile(bk2, bq2, True, delta, bias)
    eq, ek, ev, eo, edo = inputs
    el_q, el_k, el_v = outputs
    args = "" if bias is None else f", %bias: {_t(*bias[0], element=bias[3])}"
    if lse_given:
        args += f", %lse_in: {_t(G, L)}"
    q_all, kv_all = (G, L, E), (Gk, S, E)
    qT_all, kvT_all = (G, E, L), (Gk, E, S)

    def group_of(indent: str) -> str:
        if bias is None:
            return ""
        return f"""
{indent}%gb = affine.apply affine_map<(d0) -> (d0 floordiv {bias[2]})>(%g)
{indent}%gh = affine.apply affine_map<(d0) -> (d0 mod {bias[2]})>(%g)"""

    kend, key_bound = "%cS", ""
    key_loops = [(("%c0", "%cS"), False)]
    if causal:
        # keys < min(S, ceil((i0 + bq + delta) / bk) * bk): the tiles right of the diagonal
        # go; the tiles wholly left of it, keys < floor((i0 + delta + 1) / bk) * bk, need no
        # mask (a first loop without it)
        end = f"(d0 + {bq + delta + bk - 1}) floordiv {bk} * {bk}"
        key_bound = f"""
      %kend0 = affine.min affine_map<(d0) -> ({end}, {S})>(%i0)
      %kfree = affine.min affine_map<(d0) -> ((d0 + {delta + 1}) floordiv {bk} * {bk}, {end}, {S})>(%i0)"""
        kend = "%kend0"
        key_loops = [(("%c0", "%kfree"), False), (("%kfree", "%kend0"), True)]
    # pass 1: dQ, D and lse per query block -------------------------------------------------
    if lse_given:
        lse_block = f"""
      %lse = tensor.extract_slice %lse_in[%g, %i0] [1, {bq}] [1, 1] : {_t(G, L)} to {_t(bq)}"""
    else:
        lse_block = _lse(tile1, E, Gk, S, key_loops, ek)
    dq_loops, acc = "", "%dq_z"
    for i, ((lb, ub), masked) in enumerate(key_loops):
        s2, mask1 = tile1.mask("%s2_raw", "s2_m", "%e_qk", masked)
        dq_loops += f"""
      %acc{i} = scf.for %j0 = {lb} to {ub} step %cbk iter_args(%dq_i = {acc}) -> ({_t(bq, E)}) {{{_read("kT_j", "%kT", kvT_all, ek, "%gk, 0, %j0", (E, bk))}{_read("vT_j", "%vT", kvT_all, ev, "%gk, 0, %j0", (E, bk))}{_read("k_j", "%k", kv_all, ek, "%gk, %j0, 0", (bk, E))}{_contraction("s2_raw", "%qc", _t(bq, E), "%kT_j", _t(E, bk), "%z_qk", tile1.type)}{mask1}{tile1.probabilities("pr", s2, "%lse", "%e_qk")}{_contraction("dp", "%do_i", _t(bq, E), "%vT_j", _t(E, bk), "%z_qk", tile1.type)}{tile1.score_gradient("ds", "%pr", "%dp", "%d_i", "%e_qk")}{_contraction("dq_n", "%ds", tile1.type, "%k_j", _t(bk, E), "%dq_i", _t(bq, E))}
        scf.yield %dq_n : {_t(bq, E)}
      }}"""
        acc = f"%acc{i}"
    pass1 = f"""
  %p1:3 = scf.forall (%g, %qb) in ({G}, {L // bq}) shared_outs(%dq = %dq0, %d_o = %d0, %lse_o = %lse0) -> ({_t(*q_all, element=el_q)}, {_t(G, L, LANES)}, {_t(G, L, LANES)}) {{
      %i0 = affine.apply affine_map<(d0) -> (d0 * {bq})>(%qb)
      %gk = affine.apply affine_map<(d0) -> (d0 floordiv {grp})>(%g){group_of("      ")}{key_bound}
      %q_i = tensor.extract_slice %q[%g, %i0, 0] [1, {bq}, {E}] [1, 1, 1] : {_t(*q_all, element=eq)} to {_t(bq, E, element=eq)}{_scaled_input("qc", "%q_i", (bq, E), eq)}{_read("do_i", "%do", q_all, edo, "%g, %i0, 0", (bq, E), "      ")}{_read("o_i", "%o", q_all, eo, "%g, %i0, 0", (bq, E), "      ")}
      %e_q = tensor.empty() : {_t(bq)}
      %z_q = linalg.fill ins(%zero : f32) outs(%e_q : {_t(bq)}) -> {_t(bq)}
      %d_i = linalg.generic {{indexing_maps = [{_ID2}, {_ID2}, {_ROW}], iterator_types = ["parallel", "reduction"]}} ins(%do_i, %o_i : {_t(bq, E)}, {_t(bq, E)}) outs(%z_q : {_t(bq)}) {{
      ^bb0(%x: f32, %y: f32, %acc: f32):
        %p = arith.mulf %x, %y : f32
        %s = arith.addf %acc, %p : f32
        linalg.yield %s : f32
      }} -> {_t(bq)}
      %e_qk = tensor.empty() : {tile1.type}
      %z_qk = linalg.fill ins(%zero : f32) outs(%e_qk : {tile1.type}) -> {tile1.type}{lse_block}
      %dq_z = linalg.fill ins(%zero : f32) outs(%qc_e : {_t(bq, E)}) -> {_t(bq, E)}{dq_loops}{_lanes("d_l", "%d_i", bq)}{_lanes("lse_l", "%lse", bq)}
      %dq_t = tensor.extract_slice %dq[%g, %i0, 0] [1, {bq}, {E}] [1, 1, 1] : {_t(*q_all, element=el_q)} to {_t(bq, E, element=el_q)}{_scaled("dq_s", acc, _t(bq, E), "%dq_t", _t(bq, E, element=el_q), el_q)}
    scf.forall.in_parallel {{
      tensor.parallel_insert_slice %dq_s into %dq[%g, %i0, 0] [1, {bq}, {E}] [1, 1, 1] : {_t(bq, E, element=el_q)} into {_t(*q_all, element=el_q)}
      tensor.parallel_insert_slice %d_l into %d_o[%g, %i0, 0] [1, {bq}, {LANES}] [1, 1, 1] : {_t(bq, LANES)} into {_t(G, L, LANES)}
      tensor.parallel_insert_slice %lse_l into %lse_o[%g, %i0, 0] [1, {bq}, {LANES}] [1, 1, 1] : {_t(bq, LANES)} into {_t(G, L, LANES)}
    }}
  }} {{{FUSED_KERNEL}, {BACKWARD_PASS} = 1 : i64}}"""
    # pass 2: dK and dV per key block ------------------------------------------------------
    query_bound = ""
    query_loops = [(("%c0", "%cL"), False)]
    if causal:
        # queries >= max(0, floor((j0 - delta) / bq2) * bq2): the tiles above the diagonal
        # go; from ceil((j0 + bk2 - 1 - delta) / bq2) * bq2 on the tiles are wholly below
        # it (a second loop without the mask)
        start = f"(d0{_signed(-delta)}) floordiv {bq2} * {bq2}"
        query_bound = f"""
    %istart = affine.max affine_map<(d0) -> (0, {start})>(%j0)
    %qfree0 = affine.max affine_map<(d0) -> ((d0{_signed(bk2 - 1 - delta + bq2 - 1)}) floordiv {bq2} * {bq2}, {start}, 0)>(%j0)
    %qfree = affine.min affine_map<(d0) -> (d0, {L})>(%qfree0)"""
        query_loops = [(("%istart", "%qfree"), True), (("%qfree", "%cL"), False)]
    kq, ke = tile2.type, _t(bk2, E)
    block_loops, carried = "", ("%dk_h", "%dv_h")
    for i, ((lb, ub), masked) in enumerate(query_loops):
        st, mask2 = tile2.mask("%st_raw", "st_m", "%e_kq", masked)
        block_loops += f"""
      %blk{i}:2 = scf.for %i0 = {lb} to {ub} step %cbq2 iter_args(%dk_a = {carried[0]}, %dv_a = {carried[1]}) -> ({ke}, {ke}) {{{_read("qT_i", "%qT", qT_all, eq, "%g, 0, %i0", (E, bq2))}{_read("doT_i", "%doT", qT_all, edo, "%g, 0, %i0", (E, bq2))}{_read("q_i", "%q", q_all, eq, "%g, %i0, 0", (bq2, E))}{_read("do_i", "%do", q_all, edo, "%g, %i0, 0", (bq2, E))}{_from_lanes("lse_i", "%p1#2", G, L, bq2)}{_from_lanes("d_i", "%p1#1", G, L, bq2)}{_contraction("st_raw", "%kc", ke, "%qT_i", _t(E, bq2), "%z_kq", kq)}{mask2}{tile2.probabilities("pt", st, "%lse_i", "%e_kq")}{_contraction("dv_n", "%pt", kq, "%do_i", _t(bq2, E), "%dv_a", ke)}{_contraction("dpt", "%v_b", ke, "%doT_i", _t(E, bq2), "%z_kq", kq)}{tile2.score_gradient("dst", "%pt", "%dpt", "%d_i", "%e_kq")}{_contraction("dk_n", "%dst", kq, "%q_i", _t(bq2, E), "%dk_a", ke)}
        scf.yield %dk_n, %dv_n : {ke}, {ke}
      }}"""
        carried = (f"%blk{i}#0", f"%blk{i}#1")
    pass2 = f"""
  %p2:2 = scf.forall (%gk, %kb) in ({Gk}, {S // bk2}) shared_outs(%dk = %dk0, %dv = %dv0) -> ({_t(*kv_all, element=el_k)}, {_t(*kv_all, element=el_v)}) {{
    %j0 = affine.apply affine_map<(d0) -> (d0 * {bk2})>(%kb){query_bound}
    %k_b = tensor.extract_slice %k[%gk, %j0, 0] [1, {bk2}, {E}] [1, 1, 1] : {_t(*kv_all, element=ek)} to {_t(bk2, E, element=ek)}{_scaled_input("kc", "%k_b", (bk2, E), ek)}{_read("v_b", "%v", kv_all, ev, "%gk, %j0, 0", (bk2, E), "    ")}
    %z_ke = linalg.fill ins(%zero : f32) outs(%kc_e : {ke}) -> {ke}
    %e_kq = tensor.empty() : {kq}
    %z_kq = linalg.fill ins(%zero : f32) outs(%e_kq : {kq}) -> {kq}
    %heads:2 = scf.for %rq = %c0 to %cgrp step %c1 iter_args(%dk_h = %z_ke, %dv_h = %z_ke) -> ({ke}, {ke}) {{
      %g = affine.apply affine_map<(d0, d1) -> (d0 * {grp} + d1)>(%gk, %rq){group_of("      ")}{block_loops}
      scf.yield {carried[0]}, {carried[1]} : {ke}, {ke}
    }}
    %dk_t = tensor.extract_slice %dk[%gk, %j0, 0] [1, {bk2}, {E}] [1, 1, 1] : {_t(*kv_all, element=el_k)} to {_t(bk2, E, element=el_k)}{_scaled("dk_s", "%heads#0", ke, "%dk_t", _t(bk2, E, element=el_k), el_k)}
    %dv_t = tensor.extract_slice %dv[%gk, %j0, 0] [1, {bk2}, {E}] [1, 1, 1] : {_t(*kv_all, element=el_v)} to {_t(bk2, E, element=el_v)}{_scaled("dv_s", "%heads#1", ke, "%dv_t", _t(bk2, E, element=el_v), el_v, factor=None)}
    scf.forall.in_parallel {{
      tensor.parallel_insert_slice %dk_s into %dk[%gk, %j0, 0] [1, {bk2}, {E}] [1, 1, 1] : {_t(bk2, E, element=el_k)} into {_t(*kv_all, element=el_k)}
      tensor.parallel_insert_slice %dv_s into %dv[%gk, %j0, 0] [1, {bk2}, {E}] [1, 1, 1] : {_t(bk2, E, element=el_v)} into {_t(*kv_all, element=el_v)}
    }}
  }} {{{FUSED_KERNEL}, {BACKWARD_PASS} = 2 : i64}}"""
    results = (f"{_t(*q_all, element=el_q)}, {_t(*kv_all, element=el_k)}, "
               f"{_t(*kv_all, element=el_v)}")
    return f"""
func.func private @{name}(%q: {_t(*q_all, element=eq)}, %k: {_t(*kv_all, element=ek)}, %v: {_t(*kv_all, element=ev)}, %o: {_t(*q_all, element=eo)}, %do: {_t(*q_all, element=edo)}{args}) -> ({results}) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %cdelta = arith.constant {delta or 0} : index
  %cL = arith.constant {L} : index
  %cS = arith.constant {S} : index
  %cbk = arith.constant {bk} : index
  %cbq2 = arith.constant {bq2} : index
  %cgrp = arith.constant {grp} : index
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %scale = arith.constant {scale!r} : f32
  %ekT = tensor.empty() : {_t(*kvT_all, element=ek)}
  %kT = linalg.transpose ins(%k : {_t(*kv_all, element=ek)}) outs(%ekT : {_t(*kvT_all, element=ek)}) permutation = [0, 2, 1]
  %evT = tensor.empty() : {_t(*kvT_all, element=ev)}
  %vT = linalg.transpose ins(%v : {_t(*kv_all, element=ev)}) outs(%evT : {_t(*kvT_all, element=ev)}) permutation = [0, 2, 1]
  %eqT = tensor.empty() : {_t(*qT_all, element=eq)}
  %qT = linalg.transpose ins(%q : {_t(*q_all, element=eq)}) outs(%eqT : {_t(*qT_all, element=eq)}) permutation = [0, 2, 1]
  %edoT = tensor.empty() : {_t(*qT_all, element=edo)}
  %doT = linalg.transpose ins(%do : {_t(*q_all, element=edo)}) outs(%edoT : {_t(*qT_all, element=edo)}) permutation = [0, 2, 1]
  %dq0 = tensor.empty() : {_t(*q_all, element=el_q)}
  %d0 = tensor.empty() : {_t(G, L, LANES)}
  %lse0 = tensor.empty() : {_t(G, L, LANES)}
  %dk0 = tensor.empty() : {_t(*kv_all, element=el_k)}
  %dv0 = tensor.empty() : {_t(*kv_all, element=el_v)}{pass1}{pass2}
  return %p1#0, %p2#0, %p2#1 : {results}
}}
"""


def _elementwise_cast(op: ir.Operation | None, cast: str) -> bool:
    """Is `op` a linalg.generic applying `cast` (arith.extf, arith.truncf) to its one input,
    elementwise (identity maps, parallel loops)?"""
    if op is None or op.name != "linalg.generic" or len(op.operands) != 2 or len(op.results) != 1:
        return False
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    if any(not m.is_permutation or list(m.results) != list(maps[0].results) for m in maps) \
            or any(kind != "parallel" for kind in iterator_kinds(op)):
        return False
    body = [o for o in body_of(op).operations]
    return [o.name for o in body] == [cast, "linalg.yield"] and \
        body[0].operands[0] == body_of(op).arguments[0]


def _element(value: ir.Value) -> str:
    return str(ir.ShapedType(value.type).element_type)


def narrow_source(value: ir.Value) -> ir.Value:
    """The f16/bf16 tensor that `value` is an elementwise widening of, else `value`."""
    owner = defining_op(value)
    if _elementwise_cast(owner, "arith.extf") and _element(owner.operands[0]) in NARROW:
        return owner.operands[0]
    return value


def _exact_in(value: float, element: str) -> bool:
    """Is the f32 `value` exactly an f16 / bf16 number?"""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if element == "bf16":
        return bits & 0xFFFF == 0
    return struct.unpack("<e", struct.pack("<e", value))[0] == value if abs(value) < 65504 \
        else math.isinf(value)


def narrow_splat(value: ir.Value, element: str, at: ir.Operation) -> ir.Value:
    """An f32 splat constant `value` (the ones --backward seeds dO with) as an `element`
    constant, built before `at`, when every element is exactly representable there."""
    splat = constant_value(value)
    if element not in NARROW or _element(value) != "f32" or defining_op(value).name != \
            "arith.constant" or not isinstance(splat, ir.FloatAttr) or \
            not _exact_in(ir.FloatAttr(splat).value, element):
        return value
    narrow = ir.RankedTensorType.get(_shape(value), ir.Type.parse(element))
    with ir.InsertionPoint(at), at.location:
        return arith.ConstantOp(narrow, ir.DenseElementsAttr.get_splat(
            narrow, ir.FloatAttr.get(narrow.element_type, ir.FloatAttr(splat).value))).result


def rounding_reader(value: ir.Value) -> ir.Operation | None:
    """The only reader of `value` (through reshapes that are its only readers) when it
    rounds it elementwise to f16/bf16, else None."""
    readers = users(value)
    while len(readers) == 1 and readers[0].name in ("tensor.expand_shape", "tensor.collapse_shape"):
        value = readers[0].results[0]
        readers = users(value)
    if len(readers) == 1 and _elementwise_cast(readers[0], "arith.truncf") \
            and _element(readers[0].results[0]) in NARROW and readers[0].operands[0] == value:
        return readers[0]
    return None


def _external_constants(op: ir.Operation) -> list[ir.Value] | None:
    """The values defined outside `op`'s body that it reads, when all are arith.constant
    results (None otherwise)."""
    body = body_of(op)
    inside = set()
    outside = []

    def visit(nested):
        for result in nested.results:
            inside.add(result)
        for region in nested.regions:
            for block in region.blocks:
                inside.update(block.arguments)
        for value in nested.operands:
            if value not in inside and value not in list(body.arguments) and value not in outside:
                outside.append(value)
        return ir.WalkResult.ADVANCE

    for nested in body.operations:
        nested.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if any(defining_op(v) is None or defining_op(v).name != "arith.constant" for v in outside):
        return None
    return outside


def _elementwise_step(op: ir.Operation | None) -> bool:
    """Is `op` a linalg.generic of one input and one result, identity maps, parallel loops,
    no linalg.index, not reading its initial value, and reading only constants from outside
    its body?"""
    if op is None or op.name != "linalg.generic" or len(op.operands) != 2 or len(op.results) != 1:
        return False
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    identity = ir.AffineMap.get_identity(maps[0].n_dims)
    body = body_of(op)
    return all(m == identity for m in maps) and all(k == "parallel" for k in iterator_kinds(op)) \
        and not any(o.operation.name == "linalg.index" for o in body.operations) \
        and not any(True for _ in body.arguments[1].uses) and _external_constants(op) is not None


def stored_chain(value: ir.Value) -> tuple[ir.Value, list[ir.Operation]]:
    """(root, chain): `value` computed from a function argument `root` by the elementwise
    steps `chain`, first to last (a bool mask turned into 0 / -inf, then widened); (value,
    []) when it is not so computed."""
    chain, current = [], value
    while _elementwise_step(defining_op(current)):
        chain.insert(0, defining_op(current))
        current = chain[0].operands[0]
    if not chain or not isinstance(current, ir.BlockArgument):
        return value, []
    return current, chain


def _apply_chain(tile: ir.Value, chain: list[ir.Operation]) -> ir.Value:
    """The ops of `chain` applied to `tile` (elementwise: the same ops on a tile), at the
    current insertion point."""
    shape = _shape(tile)
    identity = ir.AffineMap.get_identity(len(shape))
    for op in chain:
        mapping = {}
        for constant in _external_constants(op):
            mapping[constant] = clone_op(defining_op(constant), {}).results[0]
        element = ir.RankedTensorType(op.results[0].type).element_type
        out = tensor.EmptyOp(shape, element).result
        block = body_of(op)

        def body(args, op=op, block=block, mapping=mapping):
            mapping.update(zip(block.arguments, args))
            return clone_body(op, mapping)

        tile = build_generic([tile], [out], [identity, identity],
                             ["parallel"] * len(shape), body).results[0]
    return tile


def _compute_bias_tiles(kernel_func: ir.Operation, chain: list[ir.Operation]) -> None:
    """Replace each BIAS_TILE conversion of the kernel by `chain` applied to its stored
    tile."""
    for marked in ops_named(kernel_func, "linalg.generic"):
        if BIAS_TILE not in marked.attributes:
            continue
        with ir.InsertionPoint(marked), marked.location:
            tile = _apply_chain(marked.operands[0], chain)
        marked.results[0].replace_all_uses_with(tile)
        marked.erase()


def check_tiles(target: ir.Operation, sizes, dq_tiles, dkv_tiles) -> None:
    """Illegal unless every tile divides its extent."""
    _, L, S, _ = sizes
    for what, extent, tile in (("the query rows", L, dq_tiles[0]), ("the keys", S, dq_tiles[1]),
                               ("the keys", S, dkv_tiles[0]), ("the query rows", L, dkv_tiles[1])):
        if tile < 1 or extent % tile:
            raise Illegal(target, f"tile {tile} does not divide {what} ({extent}): dq_tiles "
                                  f"{list(dq_tiles)}, dkv_tiles {list(dkv_tiles)}")


def rewrite(target: ir.Operation, bwd: AttentionBackward, at: ir.Operation, sizes,
            dq_tiles, dkv_tiles, delta: int | None) -> None:
    g, L, S, e = sizes
    taken = {ir.StringAttr(op.attributes["sym_name"]).value
             for op in block_ops(target.parent) if "sym_name" in op.attributes}
    name = next(f"attention_backward_{n}" for n in range(1, len(taken) + 2)
                if f"attention_backward_{n}" not in taken)
    bias, bias_value, chain = None, None, []
    if bwd.bias is not None:
        bias_value, chain = stored_chain(bwd.bias.value)
        bias = (_shape(bias_value), bwd.bias.roles, bwd.bias.heads, _element(bias_value))
    lse = bwd.lse if bwd.lse is not None else _forward_lse(bwd)
    sources = [dataclasses.replace(s, value=narrow_source(s.value))
               for s in (bwd.q, bwd.k, bwd.v, bwd.o, bwd.do)]
    sources = [dataclasses.replace(s, value=narrow_splat(s.value, _element(sources[0].value), at))
               for s in sources]
    gradients = (bwd.dq, bwd.dk, bwd.dv)
    readers = [rounding_reader(r) for r in gradients]
    outputs = [_element(r.results[0]) if r is not None else "f32" for r in readers]
    text = two_pass_text(name, g, L, S, e, dq_tiles, dkv_tiles, bwd.scale, delta, bias,
                         lse is not None, bwd.k.groups, tuple(_element(s.value) for s in sources),
                         tuple(outputs))
    kernel = ir.Module.parse(text)
    kernel_func = block_ops(kernel.operation)[0]
    kernel_func.detach_from_parent()
    ir.InsertionPoint(target).insert(kernel_func)
    _compute_bias_tiles(kernel_func, chain)
    args = [_canonical(s, at) for s in sources]
    if bias_value is not None:
        args.append(bias_value)
    if lse is not None:
        args.append(_canonical_rows(lse, at))
    gk = g // bwd.k.groups
    with ir.InsertionPoint(at), at.location:
        result_types = [ir.RankedTensorType.get(shape, ir.Type.parse(element))
                        for shape, element in zip(([g, L, e], [gk, S, e], [gk, S, e]), outputs)]
        call = func.CallOp(result_types, ir.FlatSymbolRefAttr.get(name), args)
    for old, reader, new in zip(gradients, readers, call.results):
        old = reader.results[0] if reader is not None else old
        with ir.InsertionPoint(at), at.location:
            new = _reshape(new, old.type)
        old.replace_all_uses_with(new)


class FuseAttentionBackwardTwoPassOp(TransformExt.Operation,
                                     name="fuse_attention_backward_two_pass"):
    target: ext.Operand[transform.AnyOpType]
    dq_tiles: ir.ArrayAttr
    dkv_tiles: ir.ArrayAttr
    causal_delta: ir.IntegerAttr  # -1: no mask

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                dq_tiles = tuple(ir.IntegerAttr(a).value for a in ir.ArrayAttr(op.dq_tiles))
                dkv_tiles = tuple(ir.IntegerAttr(a).value for a in ir.ArrayAttr(op.dkv_tiles))
                delta = ir.IntegerAttr(op.causal_delta).value
                delta = None if delta < 0 else delta
                targets = payload_ops(state, op.target)
                try:
                    plans = []
                    for t in targets:
                        if len(dq_tiles) != 2 or len(dkv_tiles) != 2:
                            raise Illegal(t, "dq_tiles and dkv_tiles are pairs of tile sizes")
                        plans.append(plan(t, dq_tiles[0], dq_tiles[1], delta))
                        if plans[-1][0].dbias is not None:
                            raise Illegal(t, "the mask needs a gradient, which the two-pass "
                                             "backward does not write")
                        if plans[-1][0].o is None:
                            raise Illegal(t, "D = rowsum(P dP) with no O to read: the two-pass "
                                             "backward reads D = rowsum(dO O)")
                        check_tiles(t, plans[-1][2], dq_tiles, dkv_tiles)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for t, (bwd, at, sizes) in zip(targets, plans):
                    rewrite(t, bwd, at, sizes, dq_tiles, dkv_tiles, delta)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_attention_backward_two_pass(func_handle: ir.Value, *, dq_tiles: tuple[int, int],
                                     dkv_tiles: tuple[int, int],
                                     causal_delta: int | None = None) -> None:
    """Replace the attention backward of each function of `func_handle` by the two-pass
    kernel (see the module docstring): dq_tiles = (query rows per block, keys per step),
    dkv_tiles = (keys per block, query rows per step)."""
    if min(*dq_tiles, *dkv_tiles) < 1:
        raise ValueError(f"tiles must be >= 1, got {dq_tiles}, {dkv_tiles}")
    i64 = ir.IntegerType.get_signless(64)
    tiles = lambda sizes: ir.ArrayAttr.get([ir.IntegerAttr.get(i64, s) for s in sizes])
    FuseAttentionBackwardTwoPassOp(func_handle, tiles(dq_tiles), tiles(dkv_tiles),
                                   ir.IntegerAttr.get(i64, -1 if causal_delta is None
                                                      else causal_delta))


__all__ = ["BACKWARD_PASS", "FuseAttentionBackwardTwoPassOp", "fuse_attention_backward_two_pass",
           "narrow_source", "rounding_reader", "two_pass_text"]
