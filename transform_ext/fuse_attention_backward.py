"""fuse_attention_backward: the attention backward as one loop nest (FlashAttention-2).

For the attention backward of each target function (transform_ext/analysis/
attention_backward.py: dQ, dK, dV from Q, K, V, O, dO with scale c), per group g of
batch x heads (an scf.forall over G) and query block i of `query_tile` rows:

    D_i = rowsum(dO_i * O_i)
    lse_i = log sum_j exp(c Q_i K_j^T)       (the forward's, see below; else a first loop
                                               over key tiles: the online max m and sum l;
                                               -inf on a fully masked row)

(when the backward has D = rowsum(P dP) and no O, as a low-precision one does, the first
loop also computes dP = dO_i V_j^T per key tile and sums d = sum_j exp(S_ij - m) dP_ij,
rescaled as m grows; D_i = d / l, 0 on a fully masked row)
    for each key tile j:  S = c Q_i K_j^T,  P = exp(S - lse_i)  (0 where lse_i = -inf),
                          dP = dO_i V_j^T,  dS = P (dP - D_i),
                          dQ_i += c dS K_j,  dK_j += c dS^T Q_i,  dV_j += P^T dO_i

with dK and dV of the group carried through the query-block loop and dQ_i through the key
loop: no L x S tensor exists, the tiles are [query_tile, key_tile]. Lengths the tiles do not
divide are padded with zeros to whole tiles (a padded query row has dO = 0 and adds nothing,
a padded key is masked out) and the results sliced back. When the K/V groups do
not divide among `threads`, each group's query blocks are shared by several forall
iterations (block i by iteration i mod splits, so a causal mask's growing rows spread
evenly), each accumulating dK and dV of its blocks apart; the shares are summed after the
forall (query_splits). A mask that is a tensor
added to the scores (torch turns a bool mask into one of 0 and -inf) is read per tile in
place, broadcast as its dims say (analysis.attention_backward.Bias); rows it masks fully
get lse = -inf, P = 0 and zero gradients. With `causal_delta`
(every masked-in score has key <= query + delta, delta >= 0) both key loops stop at the
first tile wholly right of the diagonal and the others are masked by index. K and V are
read transposed ([G, E, S], transposed once) so the score tiles' vector lanes run along the
keys. The kernel is a private function the target function calls in place of the payload's
backward (whose ops are then dead; run `inline` and canonicalization after this op). When
O is the function's first result, computed in f32 by a softmax attention (analysis.attention.
attention_of), lse comes from that forward: lse = m + log l beside O (append_lse_result's g,
which the attention schedule fuses into its query blocks as for return_lse); when the
backward reads a given lse (an input: AOTAutograd's backward graph gets the forward's), the
kernel reads it. Its
scf.forall carries the unit attribute `lh.fused_kernel` (FUSED_KERNEL): the attention's
query-block ops (pack_key_tiles.top_level_foralls) leave it alone.

Preconditions (checked on every target first; a violation is a silenceable failure naming
the op): one attention backward in the function; static f32 tensors; K and V with the
queries' groups; the value dim equal to the query/key dim; an index-computed mask in the
payload iff `causal_delta` is given
(>= 0); an additive mask f32 with broadcast dims of one; every
user of dQ, dK, dV after the last op their sources are defined by.
"""

import math

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, func, linalg, tensor, transform

from .analysis.attention_backward import AttentionBackward, NotAttentionBackward, \
    Source, attention_backward_in
from .analysis.attention import NotAttention, attention_of, final_op
from .append_lse_result import lse_beside_output
from .common import Illegal, RewritesTargets, Success, block_ops, defining_op, fail, \
    payload_ops, reassociation_attr, user_op, users
from .dialect import TransformExt

NAME = "transform_ext.fuse_attention_backward"
# the unit attribute on the kernel's scf.forall: it is fused, not a query block to fuse
FUSED_KERNEL = "lh.fused_kernel"


def kernel_text(name: str, G: int, L: int, S: int, E: int, bq: int, bk: int, scale: float,
                delta: int | None, bias: tuple | None = None,
                lse_given: bool = False, grp: int = 1, splits: int = 1,
                bias_grad: bool = False, keys: int | None = None,
                d_online: bool = False) -> str:
    """The kernel as MLIR text: func.func private @name(q, k, v, o, dO[, bias][, lse]) ->
    (dQ, dK, dV); `d_online`: no o, D = rowsum(P dP) summed in the first key loop (which
    lse is then computed by); `bias`: (its shape, its dims' roles, heads), see
    analysis.attention_backward.Bias; `lse_given`: the rows' lse [G, L] is an argument (the
    forward's), else a first key loop computes it; `grp`: query heads per K/V head (K, V,
    dK, dV have G / grp groups; query group g reads K/V group g // grp); `splits`: the query
    blocks of a group are shared by this many forall iterations (block i by i mod splits),
    each accumulating dK and dV of its blocks apart, summed after the forall; `bias_grad`:
    one more result, the bias's gradient (dS summed where the bias is broadcast): the forall
    then runs over the splits alone, each taking every group's blocks i = split mod splits,
    with dQ, dK, dV and the bias gradient accumulated apart and summed after it; `keys`: the
    keys actually there when S is padded past them (those after are masked out)."""
    Gk = G // grp
    T = splits

    def t(*dims):
        return "tensor<" + "x".join(map(str, dims)) + "xf32>"

    causal = delta is not None
    causal_bound = ""
    if causal:
        # keys < min(S, ceil((i0 + bq + delta) / bk) * bk): the tiles right of the diagonal go
        causal_bound = f"""
        %kend0 = affine.min affine_map<(d0) -> ((d0 + {bq + (delta or 0)} + {bk} - 1) floordiv {bk} * {bk}, {S})>(%i0)"""
        kend = "%kend0"
    else:
        kend = "%cS"

    def mask(src, dst_name):
        if bias is not None:
            return f"%{dst_name}", bias_tile(src, dst_name)
        if not causal:
            return src, ""
        return f"%{dst_name}", f"""
          %{dst_name} = linalg.generic {{indexing_maps = [affine_map<(a, b) -> (a, b)>, affine_map<(a, b) -> (a, b)>], iterator_types = ["parallel", "parallel"]}} ins({src} : {t(bq, bk)}) outs(%e_qk : {t(bq, bk)}) {{
          ^bb0(%s: f32, %unused: f32):
            %qi = linalg.index 0 : index
            %kj = linalg.index 1 : index
            %qa = arith.addi %qi, %i0 : index
            %ka = arith.addi %kj, %j0 : index
            %qd = arith.addi %qa, %cdelta : index
            %ok = arith.cmpi ule, %ka, %qd : index
            %r = arith.select %ok, %s, %ninf : f32
            linalg.yield %r : f32
          }} -> {t(bq, bk)}"""

    def bias_tile(src, dst_name):
        shape, roles, _ = bias
        where = {"g": "%g", "b": "%gb", "h": "%gh", "q": "%i0", "k": "%j0", "1": "0"}
        size = {"q": bq, "k": bk}
        offsets = ", ".join(where[r] for r in roles)
        sizes = ", ".join(str(size.get(r, 1)) for r in roles)
        kept = [r for r in roles if r in "qk"]
        tile = "tensor<" + "".join(f"{size[r]}x" for r in kept) + "f32>"
        tile_map = "affine_map<(a, b) -> (" + ", ".join({"q": "a", "k": "b"}[r] for r in kept) + ")>"
        return f"""
          %{dst_name}_b = tensor.extract_slice %bias[{offsets}] [{sizes}] [{", ".join("1" for _ in roles)}] : {bias_type} to {tile}
          %{dst_name} = linalg.generic {{indexing_maps = [affine_map<(a, b) -> (a, b)>, {tile_map}, affine_map<(a, b) -> (a, b)>], iterator_types = ["parallel", "parallel"]}} ins({src}, %{dst_name}_b : {t(bq, bk)}, {tile}) outs(%e_qk : {t(bq, bk)}) {{
          ^bb0(%s: f32, %bv: f32, %unused: f32):
            %r = arith.addf %s, %bv : f32
            linalg.yield %r : f32
          }} -> {t(bq, bk)}"""

    bias_type = "" if bias is None else "tensor<" + "".join(f"{d}x" for d in bias[0]) + "f32>"
    extra_args = "" if bias is None else f", %bias: {bias_type}"
    if lse_given:
        extra_args += f", %lse_in: {t(G, L)}"
    group_of = "" if bias is None else f"""
    %gb = affine.apply affine_map<(d0) -> (d0 floordiv {bias[2]})>(%g)
    %gh = affine.apply affine_map<(d0) -> (d0 mod {bias[2]})>(%g)"""
    id2 = "affine_map<(a, b) -> (a, b)>"
    row2 = "affine_map<(a, b) -> (a)>"
    mmA = "affine_map<(m, n, k) -> (m, k)>"
    mmB = "affine_map<(m, n, k) -> (k, n)>"
    mmC = "affine_map<(m, n, k) -> (m, n)>"
    mmAt = "affine_map<(m, n, k) -> (k, m)>"
    contr = lambda a, b: f"""indexing_maps = [{a}, {b}, {mmC}], iterator_types = ["parallel", "parallel", "reduction"]"""
    mac = """^bb0(%x: f32, %y: f32, %acc: f32):
            %p = arith.mulf %x, %y : f32
            %s = arith.addf %acc, %p : f32
            linalg.yield %s : f32"""
    def valid_keys(src, dst_name):
        """`src` with the padded keys (at or past `keys`) masked out."""
        if keys is None or keys >= S:
            return src, ""
        return f"%{dst_name}", f"""
          %{dst_name} = linalg.generic {{indexing_maps = [affine_map<(a, b) -> (a, b)>, affine_map<(a, b) -> (a, b)>], iterator_types = ["parallel", "parallel"]}} ins({src} : {t(bq, bk)}) outs(%e_qk : {t(bq, bk)}) {{
          ^bb0(%s: f32, %unused: f32):
            %kj = linalg.index 1 : index
            %ka = arith.addi %kj, %j0 : index
            %ok = arith.cmpi ult, %ka, %ckeys : index
            %r = arith.select %ok, %s, %ninf : f32
            linalg.yield %r : f32
          }} -> {t(bq, bk)}"""

    def masked(src, dst_name):
        value, text = mask(src, dst_name)
        value, more = valid_keys(value, dst_name + "_v")
        return value, text + more

    s1, m1 = masked("%s_raw", "s_m")

    d_update, d_final, o_rows, d_dot = "", "", "", ""
    if d_online:
        # d = sum_j exp(S_ij - m) dP_ij, rescaled as m grows; D = d / l (0 on masked rows)
        d_update = f"""
        %vT_l = tensor.extract_slice %vT[%gk, 0, %j0] [1, {E}, {bk}] [1, 1, 1] : {t(Gk, E, S)} to {t(E, bk)}
        %dp_l = linalg.generic {{{contr(mmA, mmB)}}} ins(%do_i, %vT_l : {t(bq, E)}, {t(E, bk)}) outs(%z_qk : {t(bq, bk)}) {{
          {mac}
        }} -> {t(bq, bk)}{rescaled_rows("dcorr", "%dd", t(bq), "%e_q")}{summed_rows("dn", s1, t(bq, bk), "%dcorr", t(bq), "%dp_l")}"""
        d_final = f"""
      %d_i = linalg.generic {{indexing_maps = [affine_map<(a) -> (a)>, affine_map<(a) -> (a)>, affine_map<(a) -> (a)>, affine_map<(a) -> (a)>], iterator_types = ["parallel"]}} ins(%ml#0, %ml#1, %ml#2 : {t(bq)}, {t(bq)}, {t(bq)}) outs(%e_q : {t(bq)}) {{
      ^bb0(%mx: f32, %lx: f32, %dx: f32, %y: f32):
        %dl = arith.divf %dx, %lx : f32
        %isinf = arith.cmpf oeq, %mx, %ninf : f32
        %r = arith.select %isinf, %zero, %dl : f32
        linalg.yield %r : f32
      }} -> {t(bq)}"""
    else:
        d_dot = f"""
      %d_i = linalg.generic {{indexing_maps = [{id2}, {id2}, {row2}], iterator_types = ["parallel", "reduction"]}} ins(%do_i, %o_i : {t(bq, E)}, {t(bq, E)}) outs(%z_q : {t(bq)}) {{
      ^bb0(%x: f32, %y: f32, %acc: f32):
        %p = arith.mulf %x, %y : f32
        %s = arith.addf %acc, %p : f32
        linalg.yield %s : f32
      }} -> {t(bq)}"""
        o_rows = f"""
      %o_i = tensor.extract_slice %o[%g, %i0, 0] [1, {bq}, {E}] [1, 1, 1] : {t(G, L, E)} to {t(bq, E)}"""
    s2, m2 = masked("%s2_raw", "s2_m")
    if d_online and lse_given:
        raise ValueError("d_online sums D in the key loop computing lse: lse cannot be given")
    if lse_given:
        lse_block = f"""%lse = tensor.extract_slice %lse_in[%g, %i0] [1, {bq}] [1, 1] : {t(G, L)} to {t(bq)}"""
    else:
        lse_block = f"""%m_init = linalg.fill ins(%ninf : f32) outs(%e_q : {t(bq)}) -> {t(bq)}
      %ml:{3 if d_online else 2} = scf.for %j0 = %c0 to {kend} step %cbk iter_args(%m = %m_init, %l = %z_q{", %dd = %z_q" if d_online else ""}) -> ({t(bq)}, {t(bq)}{", " + t(bq) if d_online else ""}) {{
        %kT_j = tensor.extract_slice %kT[%gk, 0, %j0] [1, {E}, {bk}] [1, 1, 1] : {t(Gk, E, S)} to {t(E, bk)}
        %s_raw = linalg.generic {{{contr(mmA, mmB)}}} ins(%qc, %kT_j : {t(bq, E)}, {t(E, bk)}) outs(%z_qk : {t(bq, bk)}) {{
          {mac}
        }} -> {t(bq, bk)}{m1}
        %mt = linalg.generic {{indexing_maps = [{id2}, {row2}], iterator_types = ["parallel", "reduction"]}} ins({s1} : {t(bq, bk)}) outs(%m : {t(bq)}) {{
        ^bb0(%x: f32, %acc: f32):
          %mx = arith.maximumf %x, %acc : f32
          linalg.yield %mx : f32
        }} -> {t(bq)}{rescaled_rows("corr", "%l", t(bq), "%e_q")}{summed_rows("ln", s1, t(bq, bk), "%corr", t(bq))}{d_update}
        scf.yield %mt, %ln{", %dn" if d_online else ""} : {t(bq)}, {t(bq)}{", " + t(bq) if d_online else ""}
      }}
      %lse = linalg.generic {{indexing_maps = [affine_map<(a) -> (a)>, affine_map<(a) -> (a)>, affine_map<(a) -> (a)>], iterator_types = ["parallel"]}} ins(%ml#0, %ml#1 : {t(bq)}, {t(bq)}) outs(%e_q : {t(bq)}) {{
      ^bb0(%mx: f32, %lx: f32, %y: f32):
        %lg = math.log %lx : f32
        %s = arith.addf %mx, %lg : f32
        %isinf = arith.cmpf oeq, %mx, %ninf : f32
        %r = arith.select %isinf, %ninf, %s : f32
        linalg.yield %r : f32
      }} -> {t(bq)}{d_final}"""
    def db_arg(name, init):
        return f", {name} = {init}" if bias_grad else ""

    def db_yield(value):
        return f", {value}" if bias_grad else ""

    n = 4 if bias_grad else 3
    db_type = f", {bias_type}" if bias_grad else ""
    db_update = _bias_gradient_tile(bias, bq, bk) if bias_grad else ""
    dk_start, dv_start = "%dk_gz", "%dv_gz"
    if bias_grad:
        q_all, kv_all = t(T, G, L, E), t(T, Gk, S, E)
        dq_start, dk_start, dv_start = "%dq_r0", "%dk_g0", "%dv_g0"
        first_block, block_step = "%i_first", "%c_step"
    elif T == 1:
        q_all, kv_all, ivs, trips, at, one = t(G, L, E), t(Gk, S, E), "%gk", f"{Gk}", "", ""
        dq_zero, dq_start, first_block, block_step = "", "%dq_r0", "%c0", "%cbq"
    else:
        q_all, kv_all, ivs, trips, at, one = (t(T, G, L, E), t(T, Gk, S, E), "%gk, %t",
                                              f"{Gk}, {T}", "%t, ", "1, ")
        # rows of dQ a split does not compute are 0 in its share
        dq_zero = f"""
    %dq_rz = linalg.fill ins(%zero : f32) outs(%dq_r0 : {t(grp, L, E)}) -> {t(grp, L, E)}
    %i_first = affine.apply affine_map<(d0) -> (d0 * {bq})>(%t)
    %c_step = arith.constant {T * bq} : index"""
        dq_start, first_block, block_step = "%dq_rz", "%i_first", "%c_step"
    shapes = [("dq", (G, L, E)), ("dk", (Gk, S, E)), ("dv", (Gk, S, E))]
    if bias_grad:
        shapes.append(("db", tuple(bias[0])))
    sums = _split_sums(shapes, T, t) if T > 1 or bias_grad else ""
    results = ", ".join(f"%{nm}_sum" for nm, _ in shapes) if sums else "%r#0, %r#1, %r#2"
    head = f"""func.func private @{name}(%q: {t(G, L, E)}, %k: {t(Gk, S, E)}, %v: {t(Gk, S, E)}{"" if d_online else ", %o: " + t(G, L, E)}, %do: {t(G, L, E)}{extra_args}) -> ({t(G, L, E)}, {t(Gk, S, E)}, {t(Gk, S, E)}{db_type}) {{
  %c0 = arith.constant 0 : index
  %cdelta = arith.constant {delta or 0} : index
  %cL = arith.constant {L} : index
  %cS = arith.constant {S} : index
  %ckeys = arith.constant {keys if keys is not None else S} : index
  %cbq = arith.constant {bq} : index
  %cbk = arith.constant {bk} : index
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %scale = arith.constant {scale!r} : f32
  %eT = tensor.empty() : {t(Gk, E, S)}
  %kT = linalg.transpose ins(%k : {t(Gk, S, E)}) outs(%eT : {t(Gk, E, S)}) permutation = [0, 2, 1]
  %vT = linalg.transpose ins(%v : {t(Gk, S, E)}) outs(%eT : {t(Gk, E, S)}) permutation = [0, 2, 1]
"""
    group = f"""    %heads:{n} = scf.for %rq = %c0 to %cgrp step %c1 iter_args(%dq_r = {dq_start}, %dk_h = {dk_start}, %dv_h = {dv_start}{db_arg('%db_h', '%db_x')}) -> ({t(grp, L, E)}, {t(S, E)}, {t(S, E)}{db_type}) {{
    %g = affine.apply affine_map<(d0, d1) -> (d0 * {grp} + d1)>(%gk, %rq){group_of}
    %dq_g0 = tensor.extract_slice %dq_r[%rq, 0, 0] [1, {L}, {E}] [1, 1, 1] : {t(grp, L, E)} to {t(L, E)}
    %blk:{n} = scf.for %i0 = {first_block} to %cL step {block_step} iter_args(%dq_g = %dq_g0, %dk_g = %dk_h, %dv_g = %dv_h{db_arg('%db_g', '%db_h')}) -> ({t(L, E)}, {t(S, E)}, {t(S, E)}{db_type}) {{{causal_bound}
      %q_i = tensor.extract_slice %q[%g, %i0, 0] [1, {bq}, {E}] [1, 1, 1] : {t(G, L, E)} to {t(bq, E)}
      %do_i = tensor.extract_slice %do[%g, %i0, 0] [1, {bq}, {E}] [1, 1, 1] : {t(G, L, E)} to {t(bq, E)}
{o_rows}
      %e_qe = tensor.empty() : {t(bq, E)}
      %qc = linalg.generic {{indexing_maps = [{id2}, {id2}], iterator_types = ["parallel", "parallel"]}} ins(%q_i : {t(bq, E)}) outs(%e_qe : {t(bq, E)}) {{
      ^bb0(%x: f32, %y: f32):
        %m = arith.mulf %x, %scale : f32
        linalg.yield %m : f32
      }} -> {t(bq, E)}
      %e_q = tensor.empty() : {t(bq)}
      %z_q = linalg.fill ins(%zero : f32) outs(%e_q : {t(bq)}) -> {t(bq)}{d_dot}
      %e_qk = tensor.empty() : {t(bq, bk)}
      %z_qk = linalg.fill ins(%zero : f32) outs(%e_qk : {t(bq, bk)}) -> {t(bq, bk)}
      {lse_block}
      %dq_z = linalg.fill ins(%zero : f32) outs(%e_qe : {t(bq, E)}) -> {t(bq, E)}
      %acc:{n} = scf.for %j0 = %c0 to {kend} step %cbk iter_args(%dq_i = %dq_z, %dk_a = %dk_g, %dv_a = %dv_g{db_arg('%db_a', '%db_g')}) -> ({t(bq, E)}, {t(S, E)}, {t(S, E)}{db_type}) {{
        %kT_j = tensor.extract_slice %kT[%gk, 0, %j0] [1, {E}, {bk}] [1, 1, 1] : {t(Gk, E, S)} to {t(E, bk)}
        %vT_j = tensor.extract_slice %vT[%gk, 0, %j0] [1, {E}, {bk}] [1, 1, 1] : {t(Gk, E, S)} to {t(E, bk)}
        %k_j = tensor.extract_slice %k[%gk, %j0, 0] [1, {bk}, {E}] [1, 1, 1] : {t(Gk, S, E)} to {t(bk, E)}
        %s2_raw = linalg.generic {{{contr(mmA, mmB)}}} ins(%qc, %kT_j : {t(bq, E)}, {t(E, bk)}) outs(%z_qk : {t(bq, bk)}) {{
          {mac}
        }} -> {t(bq, bk)}{m2}
        %pr = linalg.generic {{indexing_maps = [{id2}, {row2}, {id2}], iterator_types = ["parallel", "parallel"]}} ins({s2}, %lse : {t(bq, bk)}, {t(bq)}) outs(%e_qk : {t(bq, bk)}) {{
        ^bb0(%x: f32, %ls: f32, %y: f32):
          %isinf = arith.cmpf oeq, %ls, %ninf : f32
          %d = arith.subf %x, %ls : f32
          %ex = math.exp %d : f32
          %r = arith.select %isinf, %zero, %ex : f32
          linalg.yield %r : f32
        }} -> {t(bq, bk)}
        %dp = linalg.generic {{{contr(mmA, mmB)}}} ins(%do_i, %vT_j : {t(bq, E)}, {t(E, bk)}) outs(%z_qk : {t(bq, bk)}) {{
          {mac}
        }} -> {t(bq, bk)}
        %ds = linalg.generic {{indexing_maps = [{id2}, {id2}, {row2}, {id2}], iterator_types = ["parallel", "parallel"]}} ins(%pr, %dp, %d_i : {t(bq, bk)}, {t(bq, bk)}, {t(bq)}) outs(%e_qk : {t(bq, bk)}) {{
        ^bb0(%pp: f32, %dpp: f32, %dd: f32, %y: f32):
          %df = arith.subf %dpp, %dd : f32
          %r = arith.mulf %pp, %df : f32
          linalg.yield %r : f32
        }} -> {t(bq, bk)}{db_update}
        %dq_n = linalg.generic {{{contr(mmA, mmB)}}} ins(%ds, %k_j : {t(bq, bk)}, {t(bk, E)}) outs(%dq_i : {t(bq, E)}) {{
          {mac}
        }} -> {t(bq, E)}
        %dk_j = tensor.extract_slice %dk_a[%j0, 0] [{bk}, {E}] [1, 1] : {t(S, E)} to {t(bk, E)}
        %dk_n = linalg.generic {{{contr(mmAt, mmB)}}} ins(%ds, %qc : {t(bq, bk)}, {t(bq, E)}) outs(%dk_j : {t(bk, E)}) {{
          {mac}
        }} -> {t(bk, E)}
        %dk_u = tensor.insert_slice %dk_n into %dk_a[%j0, 0] [{bk}, {E}] [1, 1] : {t(bk, E)} into {t(S, E)}
        %dv_j = tensor.extract_slice %dv_a[%j0, 0] [{bk}, {E}] [1, 1] : {t(S, E)} to {t(bk, E)}
        %dv_n = linalg.generic {{{contr(mmAt, mmB)}}} ins(%pr, %do_i : {t(bq, bk)}, {t(bq, E)}) outs(%dv_j : {t(bk, E)}) {{
          {mac}
        }} -> {t(bk, E)}
        %dv_u = tensor.insert_slice %dv_n into %dv_a[%j0, 0] [{bk}, {E}] [1, 1] : {t(bk, E)} into {t(S, E)}
        scf.yield %dq_n, %dk_u, %dv_u{db_yield('%db_u')} : {t(bq, E)}, {t(S, E)}, {t(S, E)}{db_type}
      }}
      %dq_s = linalg.generic {{indexing_maps = [{id2}, {id2}], iterator_types = ["parallel", "parallel"]}} ins(%acc#0 : {t(bq, E)}) outs(%e_qe : {t(bq, E)}) {{
      ^bb0(%x: f32, %y: f32):
        %m = arith.mulf %x, %scale : f32
        linalg.yield %m : f32
      }} -> {t(bq, E)}
      %dq_u = tensor.insert_slice %dq_s into %dq_g[%i0, 0] [{bq}, {E}] [1, 1] : {t(bq, E)} into {t(L, E)}
      scf.yield %dq_u, %acc#1, %acc#2{db_yield('%acc#3')} : {t(L, E)}, {t(S, E)}, {t(S, E)}{db_type}
    }}
    %dq_rn = tensor.insert_slice %blk#0 into %dq_r[%rq, 0, 0] [1, {L}, {E}] [1, 1, 1] : {t(L, E)} into {t(grp, L, E)}
    scf.yield %dq_rn, %blk#1, %blk#2{db_yield('%blk#3')} : {t(grp, L, E)}, {t(S, E)}, {t(S, E)}{db_type}
    }}
"""
    if bias_grad:
        outer = _bias_gradient_outer(t, G, Gk, L, S, E, bq, grp, T, bias_type, group)
    else:
        outer = f"""  %dq0 = tensor.empty() : {q_all}
  %dk0 = tensor.empty() : {kv_all}
  %dv0 = tensor.empty() : {kv_all}
  %cgrp = arith.constant {grp} : index
  %c1 = arith.constant 1 : index
  %r:3 = scf.forall ({ivs}) in ({trips}) shared_outs(%dq = %dq0, %dk = %dk0, %dv = %dv0) -> ({q_all}, {kv_all}, {kv_all}) {{
    %dk_g0 = tensor.extract_slice %dk[{at}%gk, 0, 0] [{one}1, {S}, {E}] [{one}1, 1, 1] : {kv_all} to {t(S, E)}
    %dv_g0 = tensor.extract_slice %dv[{at}%gk, 0, 0] [{one}1, {S}, {E}] [{one}1, 1, 1] : {kv_all} to {t(S, E)}
    %g0 = affine.apply affine_map<(d0) -> (d0 * {grp})>(%gk)
    %dq_r0 = tensor.extract_slice %dq[{at}%g0, 0, 0] [{one}{grp}, {L}, {E}] [{one}1, 1, 1] : {q_all} to {t(grp, L, E)}{dq_zero}
    %dk_gz = linalg.fill ins(%zero : f32) outs(%dk_g0 : {t(S, E)}) -> {t(S, E)}
    %dv_gz = linalg.fill ins(%zero : f32) outs(%dv_g0 : {t(S, E)}) -> {t(S, E)}
""" + group + f"""    scf.forall.in_parallel {{
      tensor.parallel_insert_slice %heads#0 into %dq[{at}%g0, 0, 0] [{one}{grp}, {L}, {E}] [{one}1, 1, 1] : {t(grp, L, E)} into {q_all}
      tensor.parallel_insert_slice %heads#1 into %dk[{at}%gk, 0, 0] [{one}1, {S}, {E}] [{one}1, 1, 1] : {t(S, E)} into {kv_all}
      tensor.parallel_insert_slice %heads#2 into %dv[{at}%gk, 0, 0] [{one}1, {S}, {E}] [{one}1, 1, 1] : {t(S, E)} into {kv_all}
    }}
  }} {{{FUSED_KERNEL}}}"""
    return head + outer + f"""{sums}
  return {results} : {t(G, L, E)}, {t(Gk, S, E)}, {t(Gk, S, E)}{db_type}
}}
"""


_ID1 = "affine_map<(a) -> (a)>"


def rescaled_rows(name: str, carried: str, rows: str, dest: str) -> str:
    """%name = carried exp(%m - %mt) per row (an online sum as the running max grows from
    %m to %mt), 0 while %m = -inf (nothing summed yet); `rows` the rows' tensor type,
    `dest` an unread init of it."""
    return f"""
        %{name} = linalg.generic {{indexing_maps = [{_ID1}, {_ID1}, {_ID1}, {_ID1}], iterator_types = ["parallel"]}} ins(%m, %mt, {carried} : {rows}, {rows}, {rows}) outs({dest} : {rows}) {{
        ^bb0(%mo: f32, %mn: f32, %lo: f32, %y: f32):
          %isinf = arith.cmpf oeq, %mo, %ninf : f32
          %dm = arith.subf %mo, %mn : f32
          %ex = math.exp %dm : f32
          %sc = arith.mulf %lo, %ex : f32
          %r = arith.select %isinf, %zero, %sc : f32
          linalg.yield %r : f32
        }} -> {rows}"""


def summed_rows(name: str, scores: str, tile: str, init: str, rows: str,
                weights: str | None = None) -> str:
    """%name = init + sum_j exp(S_ij - %mt) [weights_ij] per row of the `scores` tile (type
    `tile`), 0 where %mt = -inf."""
    ins, types, arg, weigh, value = "", "", "", "", "%ex"
    if weights is not None:
        ins, types, arg = f", {weights}", f", {tile}", ", %wx: f32"
        weigh, value = """
          %w = arith.mulf %ex, %wx : f32""", "%w"
    id2, row = "affine_map<(a, b) -> (a, b)>", "affine_map<(a, b) -> (a)>"
    maps = f"{id2}, {row}" + (f", {id2}" if weights is not None else "") + f", {row}"
    return f"""
        %{name} = linalg.generic {{indexing_maps = [{maps}], iterator_types = ["parallel", "reduction"]}} ins({scores}, %mt{ins} : {tile}, {rows}{types}) outs({init} : {rows}) {{
        ^bb0(%x: f32, %mn: f32{arg}, %acc: f32):
          %isinf = arith.cmpf oeq, %mn, %ninf : f32
          %d = arith.subf %x, %mn : f32
          %ex = math.exp %d : f32{weigh}
          %r = arith.select %isinf, %zero, {value} : f32
          %s = arith.addf %acc, %r : f32
          linalg.yield %s : f32
        }} -> {rows}"""


def _tensor_type(*dims) -> str:
    return "tensor<" + "".join(f"{d}x" for d in dims) + "f32>"


def _bias_tile_view(bias: tuple, bq: int, bk: int):
    """(offsets, sizes, strides, the tile's type, its map from a score tile's (query, key),
    the tile dims kept) of the bias's slice under one [bq, bk] score tile (see Bias: its
    dims' roles)."""
    shape, roles, _ = bias
    where = {"g": "%g", "b": "%gb", "h": "%gh", "q": "%i0", "k": "%j0", "1": "0"}
    size = {"q": bq, "k": bk}
    kept = [r for r in roles if r in "qk"]
    return (", ".join(where[r] for r in roles), ", ".join(str(size.get(r, 1)) for r in roles),
            ", ".join("1" for _ in roles), _tensor_type(*(size[r] for r in kept)),
            "affine_map<(a, b) -> (" + ", ".join({"q": "a", "k": "b"}[r] for r in kept) + ")>",
            kept)


def _bias_gradient_tile(bias: tuple, bq: int, bk: int) -> str:
    """The bias gradient's update by one dS tile: dS summed over the tile dims the bias is
    broadcast along, added into the bias's slice (%db_a -> %db_u)."""
    offsets, sizes, strides, tile, tile_map, kept = _bias_tile_view(bias, bq, bk)
    bias_type = _tensor_type(*bias[0])
    kinds = ", ".join('"parallel"' if r in kept else '"reduction"' for r in "qk")
    return f"""
        %db_j = tensor.extract_slice %db_a[{offsets}] [{sizes}] [{strides}] : {bias_type} to {tile}
        %db_n = linalg.generic {{indexing_maps = [affine_map<(a, b) -> (a, b)>, {tile_map}], iterator_types = [{kinds}]}} ins(%ds : {_tensor_type(bq, bk)}) outs(%db_j : {tile}) {{
        ^bb0(%x: f32, %acc: f32):
          %s = arith.addf %acc, %x : f32
          linalg.yield %s : f32
        }} -> {tile}
        %db_u = tensor.insert_slice %db_n into %db_a[{offsets}] [{sizes}] [{strides}] : {tile} into {bias_type}"""


def _split_sums(shapes: list, T: int, t) -> str:
    """Each `name` of `shapes` summed over the leading splits dim of %r#i: %name_sum."""
    text = ""
    for i, (nm, shape) in enumerate(shapes):
        dims = ", ".join(f"d{j}" for j in range(len(shape)))
        maps = (f"affine_map<(s, {dims}) -> (s, {dims})>, affine_map<(s, {dims}) -> ({dims})>"
                if shape else "affine_map<(s) -> (s)>, affine_map<(s) -> ()>")
        kinds = ", ".join(['"reduction"'] + ['"parallel"'] * len(shape))
        text += f"""
  %{nm}_e = tensor.empty() : {t(*shape)}
  %{nm}_z = linalg.fill ins(%zero : f32) outs(%{nm}_e : {t(*shape)}) -> {t(*shape)}
  %{nm}_sum = linalg.generic {{indexing_maps = [{maps}], iterator_types = [{kinds}]}} ins(%r#{i} : {t(T, *shape)}) outs(%{nm}_z : {t(*shape)}) {{
  ^bb0(%x: f32, %acc: f32):
    %s = arith.addf %acc, %x : f32
    linalg.yield %s : f32
  }} -> {t(*shape)}"""
    return text


def _bias_gradient_outer(t, G, Gk, L, S, E, bq, grp, T, bias_type, group) -> str:
    """The forall over the splits, each running every group (kernel_text's bias_grad)."""
    bias_shape = bias_type.removeprefix("tensor<").removesuffix("f32>")
    db_all = f"tensor<{T}x{bias_shape}f32>"
    dims = [d for d in bias_shape.split("x") if d]
    zeros, ones = "".join(", 0" for _ in dims), "".join(", 1" for _ in dims)
    at = f"[%t{zeros}] [1{''.join(', ' + d for d in dims)}] [1{ones}]"
    return f"""  %dq0 = tensor.empty() : {t(T, G, L, E)}
  %dk0 = tensor.empty() : {t(T, Gk, S, E)}
  %dv0 = tensor.empty() : {t(T, Gk, S, E)}
  %db0 = tensor.empty() : {db_all}
  %cgrp = arith.constant {grp} : index
  %c1 = arith.constant 1 : index
  %cGk = arith.constant {Gk} : index
  %c_step = arith.constant {T * bq} : index
  %r:4 = scf.forall (%t) in ({T}) shared_outs(%dq = %dq0, %dk = %dk0, %dv = %dv0, %db = %db0) -> ({t(T, G, L, E)}, {t(T, Gk, S, E)}, {t(T, Gk, S, E)}, {db_all}) {{
    %dq_t0 = tensor.extract_slice %dq[%t, 0, 0, 0] [1, {G}, {L}, {E}] [1, 1, 1, 1] : {t(T, G, L, E)} to {t(G, L, E)}
    %dk_t0 = tensor.extract_slice %dk[%t, 0, 0, 0] [1, {Gk}, {S}, {E}] [1, 1, 1, 1] : {t(T, Gk, S, E)} to {t(Gk, S, E)}
    %dv_t0 = tensor.extract_slice %dv[%t, 0, 0, 0] [1, {Gk}, {S}, {E}] [1, 1, 1, 1] : {t(T, Gk, S, E)} to {t(Gk, S, E)}
    %db_t0 = tensor.extract_slice %db{at} : {db_all} to {bias_type}
    %dq_tz = linalg.fill ins(%zero : f32) outs(%dq_t0 : {t(G, L, E)}) -> {t(G, L, E)}
    %dk_tz = linalg.fill ins(%zero : f32) outs(%dk_t0 : {t(Gk, S, E)}) -> {t(Gk, S, E)}
    %dv_tz = linalg.fill ins(%zero : f32) outs(%dv_t0 : {t(Gk, S, E)}) -> {t(Gk, S, E)}
    %db_tz = linalg.fill ins(%zero : f32) outs(%db_t0 : {bias_type}) -> {bias_type}
    %i_first = affine.apply affine_map<(d0) -> (d0 * {bq})>(%t)
    %grs:4 = scf.for %gk = %c0 to %cGk step %c1 iter_args(%dq_t = %dq_tz, %dk_t = %dk_tz, %dv_t = %dv_tz, %db_x = %db_tz) -> ({t(G, L, E)}, {t(Gk, S, E)}, {t(Gk, S, E)}, {bias_type}) {{
    %dk_g0 = tensor.extract_slice %dk_t[%gk, 0, 0] [1, {S}, {E}] [1, 1, 1] : {t(Gk, S, E)} to {t(S, E)}
    %dv_g0 = tensor.extract_slice %dv_t[%gk, 0, 0] [1, {S}, {E}] [1, 1, 1] : {t(Gk, S, E)} to {t(S, E)}
    %g0 = affine.apply affine_map<(d0) -> (d0 * {grp})>(%gk)
    %dq_r0 = tensor.extract_slice %dq_t[%g0, 0, 0] [{grp}, {L}, {E}] [1, 1, 1] : {t(G, L, E)} to {t(grp, L, E)}
{group}    %dq_tn = tensor.insert_slice %heads#0 into %dq_t[%g0, 0, 0] [{grp}, {L}, {E}] [1, 1, 1] : {t(grp, L, E)} into {t(G, L, E)}
    %dk_tn = tensor.insert_slice %heads#1 into %dk_t[%gk, 0, 0] [1, {S}, {E}] [1, 1, 1] : {t(S, E)} into {t(Gk, S, E)}
    %dv_tn = tensor.insert_slice %heads#2 into %dv_t[%gk, 0, 0] [1, {S}, {E}] [1, 1, 1] : {t(S, E)} into {t(Gk, S, E)}
    scf.yield %dq_tn, %dk_tn, %dv_tn, %heads#3 : {t(G, L, E)}, {t(Gk, S, E)}, {t(Gk, S, E)}, {bias_type}
    }}
    scf.forall.in_parallel {{
      tensor.parallel_insert_slice %grs#0 into %dq[%t, 0, 0, 0] [1, {G}, {L}, {E}] [1, 1, 1, 1] : {t(G, L, E)} into {t(T, G, L, E)}
      tensor.parallel_insert_slice %grs#1 into %dk[%t, 0, 0, 0] [1, {Gk}, {S}, {E}] [1, 1, 1, 1] : {t(Gk, S, E)} into {t(T, Gk, S, E)}
      tensor.parallel_insert_slice %grs#2 into %dv[%t, 0, 0, 0] [1, {Gk}, {S}, {E}] [1, 1, 1, 1] : {t(Gk, S, E)} into {t(T, Gk, S, E)}
      tensor.parallel_insert_slice %grs#3 into %db{at} : {bias_type} into {db_all}
    }}
  }} {{{FUSED_KERNEL}}}"""


def _padded_shape(bias: tuple, Lp: int, Sp: int) -> list[int]:
    """The bias's shape with its query and key dims padded to Lp and Sp."""
    shape, roles, _ = bias
    return [Lp if r == "q" else Sp if r == "k" else d for d, r in zip(shape, roles)]


def _pad_to(value: ir.Value, shape: list[int]) -> ir.Value:
    """`value` at the start of a zero tensor of `shape` (itself when it has that shape)."""
    if _shape(value) == list(shape):
        return value
    element = ir.ShapedType(value.type).element_type
    zero = arith.ConstantOp(element, 0.0).result
    padded = linalg.fill(zero, outs=[tensor.EmptyOp(list(shape), element).result])
    return tensor.InsertSliceOp(value, padded, [], [], [], [0] * len(shape), _shape(value),
                                [1] * len(shape)).result


def _slice_to(value: ir.Value, shape: list[int]) -> ir.Value:
    """The leading `shape` corner of `value` (itself when it has that shape)."""
    if _shape(value) == list(shape):
        return value
    result = ir.RankedTensorType.get(list(shape), ir.ShapedType(value.type).element_type)
    return tensor.ExtractSliceOp(result, value, [], [], [], [0] * len(shape), list(shape),
                                 [1] * len(shape)).result


def _reshape(value: ir.Value, to: ir.Type) -> ir.Value:
    """`value` as type `to`, a shape with as many elements in the same order (built here:
    collapsed to one dim, then expanded)."""
    src, dst = _shape(value), list(ir.ShapedType(to).shape)
    if src == dst:
        return value
    element = ir.ShapedType(value.type).element_type
    flat = ir.RankedTensorType.get([math.prod(src)], element)
    if len(src) != 1:
        value = tensor.CollapseShapeOp(flat, value,
                                       reassociation_attr([list(range(len(src)))])).result
    if len(dst) != 1:
        value = tensor.ExpandShapeOp(to, value, reassociation_attr([list(range(len(dst)))]), [],
                                     dst).result
    return value


def _shape(value: ir.Value) -> list[int]:
    return list(ir.ShapedType(value.type).shape)


def _groups_rows_cols(src: Source) -> tuple[int, int, int]:
    shape = _shape(src.value)
    g = math.prod(shape[:-2])
    rows, cols = shape[-2:]
    return (g, cols, rows) if src.transposed else (g, rows, cols)


def plan(target: ir.Operation, query_tile: int, key_tile: int, delta: int | None):
    """(the backward, the insertion point op, kernel sizes) or Illegal."""
    if target.name != "func.func":
        raise Illegal(target, "not a function")
    try:
        bwd = attention_backward_in(target)
    except NotAttentionBackward as exc:
        raise Illegal(target, str(exc))
    srcs = [s for s in (bwd.q, bwd.k, bwd.v, bwd.o, bwd.do) if s is not None]
    for s in srcs + [Source(bwd.dq, False), Source(bwd.dk, False), Source(bwd.dv, False)]:
        t = ir.ShapedType(s.value.type)
        if not t.has_static_shape or str(t.element_type) != "f32" or t.rank < 2:
            raise Illegal(target, f"the attention backward's tensors must be static f32 of rank "
                                  f"2 or more, found {t}")
    (g, L, e), (gk, S, ek), (gv, Sv, ev) = map(_groups_rows_cols, srcs[:3])
    grp = bwd.k.groups
    if (gk * grp, gv * grp) != (g, g) or Sv != S or ek != e or ev != e or \
            any(_groups_rows_cols(s) != (g, L, e) for s in srcs[3:]):
        raise Illegal(target, f"Q {_shape(bwd.q.value)}, K {_shape(bwd.k.value)}, V "
                              f"{_shape(bwd.v.value)}: the kernel needs K and V with the queries' "
                              f"heads (or a group of them each) and one head dim")
    if (bwd.masked and bwd.bias is None) != (delta is not None):
        raise Illegal(bwd.row_max, "the scores are masked but no causal delta is given"
                      if bwd.masked else "a causal delta is given but the scores carry no "
                      "index-computed mask")
    if delta is not None and delta < 0:
        raise Illegal(target, f"causal_delta must be >= 0, got {delta}")
    ops = block_ops(target)
    position = {op: i for i, op in enumerate(ops)}
    last_source = max((position[defining_op(s.value)] for s in srcs
                       if defining_op(s.value) in position), default=-1)
    results = [bwd.dq, bwd.dk, bwd.dv]
    readers = [u for r in results for u in users(r)] + [op for op, _ in bwd.dbias or []]
    first_user = min(position[u] for u in readers if u in position)
    if first_user <= last_source:
        raise Illegal(ops[first_user], "a user of the gradients comes before their sources")
    return bwd, ops[first_user], (g, L, S, e)


def _groups_of(rank: int) -> list[list[int]]:
    """The reassociation merging all but the last two dims of a rank-`rank` tensor."""
    return [list(range(rank - 2)), [rank - 2], [rank - 1]]


def _grouped_type(shape: list[int], element: ir.Type | None = None) -> ir.Type:
    g = math.prod(shape[:-2])
    return ir.RankedTensorType.get([g] + shape[-2:], element or ir.F32Type.get())


def _canonical(src: Source, at: ir.Operation) -> ir.Value:
    """`src` as a [G, rows, features] tensor (of its element type), built before `at`."""
    value = src.value
    element = ir.ShapedType(value.type).element_type
    with ir.InsertionPoint(at), at.location:
        shape = _shape(value)
        if len(shape) > 3:
            value = tensor.CollapseShapeOp(_grouped_type(shape, element), value,
                                           reassociation_attr(_groups_of(len(shape)))).result
        elif len(shape) == 2:
            t = ir.RankedTensorType.get([1] + shape, element)
            value = tensor.ExpandShapeOp(t, value, reassociation_attr([[0, 1], [2]]), [],
                                         [1] + shape).result
        if src.transposed:
            g, rows, cols = _shape(value)
            init = tensor.EmptyOp([g, cols, rows], element).result
            value = linalg.transpose(value, outs=[init], permutation=[0, 2, 1])
    return value


def _forward_lse(bwd: AttentionBackward) -> ir.Value | None:
    """The rows' lse from the forward attention that computes O, when O is its output, the
    function's first result, in f32 with an f32 row max and sum: lse = m + log(l) beside O
    (append_lse_result's g, built right after the output op, which then hands O to O's other
    readers; the attention schedule fuses g as it does for return_lse); else None (an
    f16/bf16 O reaches the backward widened: the kernel computes lse itself)."""
    try:
        ops = attention_of(bwd.o.value)
    except NotAttention:
        return None
    out = ops.output.results[0]
    if out != bwd.o.value or ops.output != final_op(ops.output.parent) or any(
            str(ir.ShapedType(v.type).element_type) != "f32"
            for v in (out, ops.row_max.results[0], ops.row_sum.results[0])):
        return None
    block = block_ops(ops.output.block)
    g, lse = lse_beside_output(ops, block[block.index(ops.output) + 1])
    for use in list(out.uses):
        if user_op(use) != g.operation:
            use.owner.operands[use.operand_number] = g.results[0]
    bwd.o = Source(g.results[0], bwd.o.transposed)
    return lse


def _canonical_rows(rows: ir.Value, at: ir.Operation) -> ir.Value:
    """[..., L] rows as [G, L], built before `at`."""
    shape = _shape(rows)
    with ir.InsertionPoint(at), at.location:
        if len(shape) == 1:
            t = ir.RankedTensorType.get([1] + shape, ir.F32Type.get())
            return tensor.ExpandShapeOp(t, rows, reassociation_attr([[0, 1]]), [], [1] + shape).result
        if len(shape) > 2:
            g = math.prod(shape[:-1])
            t = ir.RankedTensorType.get([g, shape[-1]], ir.F32Type.get())
            groups = [list(range(len(shape) - 1)), [len(shape) - 1]]
            return tensor.CollapseShapeOp(t, rows, reassociation_attr(groups)).result
    return rows


def query_splits(kv_groups: int, query_blocks: int, threads: int) -> int:
    """How many forall iterations share a K/V group's query blocks so that `threads` get
    equal work: 1 when the groups divide among them, else the fewest making the iterations
    a multiple of the threads (at most the blocks)."""
    if kv_groups % threads == 0:
        return 1
    return max(1, min(threads // math.gcd(kv_groups, threads), query_blocks))


def rewrite(target: ir.Operation, bwd: AttentionBackward, at: ir.Operation, sizes,
            query_tile: int, key_tile: int, delta: int | None, threads: int = 1) -> None:
    g, L, S, e = sizes
    taken = {ir.StringAttr(op.attributes["sym_name"]).value
             for op in block_ops(target.parent) if "sym_name" in op.attributes}
    name = next(f"attention_backward_{n}" for n in range(1, len(taken) + 2)
                if f"attention_backward_{n}" not in taken)
    bias = None if bwd.bias is None else (_shape(bwd.bias.value), bwd.bias.roles, bwd.bias.heads)
    d_online = bwd.o is None
    # D summed online needs the key loop that computes lse: a given lse goes unread
    lse = None if d_online else bwd.lse if bwd.lse is not None else _forward_lse(bwd)
    bias_grad = bwd.dbias is not None
    # lengths the tiles do not divide: the rows padded with zeros to whole tiles (a padded
    # query has dO = 0 and adds nothing; a padded key is masked out), the results sliced back
    Lp, Sp = -(-L // query_tile) * query_tile, -(-S // key_tile) * key_tile
    blocks = Lp // query_tile
    splits = min(blocks, threads) if bias_grad else \
        query_splits(g // bwd.k.groups, blocks, threads)
    pad_bias = None if bias is None else _padded_shape(bias, Lp, Sp)
    kernel = ir.Module.parse(kernel_text(
        name, g, Lp, Sp, e, query_tile, key_tile, bwd.scale, delta,
        None if bias is None else (pad_bias, bias[1], bias[2]), lse is not None,
        bwd.k.groups, splits, bias_grad, keys=S, d_online=d_online))
    kernel_func = block_ops(kernel.operation)[0]
    kernel_func.detach_from_parent()
    ir.InsertionPoint(target).insert(kernel_func)
    sources = [(s, rows) for s, rows in zip((bwd.q, bwd.k, bwd.v, bwd.o, bwd.do),
                                            (Lp, Sp, Sp, Lp, Lp)) if s is not None]
    args = [_canonical(s, at) for s, _ in sources]
    with ir.InsertionPoint(at), at.location:
        args = [_pad_to(a, [_shape(a)[0], rows, e]) for a, (_, rows) in zip(args, sources)]
        if bwd.bias is not None:
            args.append(_pad_to(bwd.bias.value, pad_bias))
    if lse is not None:
        rows = _canonical_rows(lse, at)
        with ir.InsertionPoint(at), at.location:
            args.append(_pad_to(rows, [g, Lp]))
    with ir.InsertionPoint(at), at.location:
        gk = g // bwd.k.groups
        result_types = [ir.RankedTensorType.get([g, Lp, e], ir.F32Type.get()),
                        ir.RankedTensorType.get([gk, Sp, e], ir.F32Type.get()),
                        ir.RankedTensorType.get([gk, Sp, e], ir.F32Type.get())]
        if bias_grad:
            result_types.append(ir.RankedTensorType.get(pad_bias, ir.F32Type.get()))
        call = func.CallOp(result_types, ir.FlatSymbolRefAttr.get(name), args)
        results = [_slice_to(r, shape) for r, shape in
                   zip(call.results, ([g, L, e], [gk, S, e], [gk, S, e]))]
        for op, index in bwd.dbias or []:
            dbias = _slice_to(call.results[3], _shape(bwd.bias.value))
            op.operands[index] = _reshape(dbias, op.operands[index].type)
    for old, new in zip((bwd.dq, bwd.dk, bwd.dv), results):
        rank = ir.ShapedType(old.type).rank
        with ir.InsertionPoint(at), at.location:
            if rank > 3:
                new = tensor.ExpandShapeOp(old.type, new, reassociation_attr(_groups_of(rank)),
                                           [], _shape(old)).result
            elif rank == 2:
                new = tensor.CollapseShapeOp(old.type, new, reassociation_attr([[0, 1], [2]])).result
        old.replace_all_uses_with(new)


class FuseAttentionBackwardOp(TransformExt.Operation, name="fuse_attention_backward"):
    target: ext.Operand[transform.AnyOpType]
    query_tile: ir.IntegerAttr
    key_tile: ir.IntegerAttr
    causal_delta: ir.IntegerAttr  # -1: no mask
    threads: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                qt = ir.IntegerAttr(op.query_tile).value
                kt = ir.IntegerAttr(op.key_tile).value
                delta = ir.IntegerAttr(op.causal_delta).value
                delta = None if delta < 0 else delta
                threads = ir.IntegerAttr(op.threads).value
                targets = payload_ops(state, op.target)
                try:
                    plans = [plan(t, qt, kt, delta) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for t, (bwd, at, sizes) in zip(targets, plans):
                    rewrite(t, bwd, at, sizes, qt, kt, delta, threads)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_attention_backward(func_handle: ir.Value, *, query_tile: int, key_tile: int,
                            causal_delta: int | None = None, threads: int = 1) -> None:
    """Replace the attention backward of each function of `func_handle` by the fused
    kernel (see the module docstring); its forall iterations are balanced for `threads`."""
    if query_tile < 1 or key_tile < 1 or threads < 1:
        raise ValueError(f"tiles and threads must be >= 1, got {query_tile}, {key_tile}, {threads}")
    i64 = ir.IntegerType.get_signless(64)
    FuseAttentionBackwardOp(func_handle, ir.IntegerAttr.get(i64, query_tile),
                            ir.IntegerAttr.get(i64, key_tile),
                            ir.IntegerAttr.get(i64, -1 if causal_delta is None else causal_delta),
                            ir.IntegerAttr.get(i64, threads))


__all__ = ["FuseAttentionBackwardOp", "fuse_attention_backward", "kernel_text", "query_splits",
           "rescaled_rows", "summed_rows"]
