"""Small attention payloads in the normalized form the attention schedule works on:
S = [c *] Q transpose(K), m = max_j S, E = exp(S - m), l = sum_j E, O = E V (returned with l)."""

SHAPES = dict(B=2, L=4, S=8, D=16, E=6)


def attention(scale: str = "", scores_reader_extra: str = "") -> str:
    """`scale`: a constant multiplying S in its own elementwise generic ('' for none).
    `scores_reader_extra`: an extra op reading S (for rejection tests)."""
    b, l, s, d, e = (SHAPES[k] for k in "BLSDE")
    scaled = "%s"
    scale_op = ""
    if scale:
        scaled = "%sc"
        scale_op = f"""
  %c = arith.constant {scale} : f32
  %sc = linalg.generic {{indexing_maps = [#id3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%s : tensor<{b}x{l}x{s}xf32>) outs(%es : tensor<{b}x{l}x{s}xf32>) {{
  ^bb0(%x: f32, %o: f32):
    %0 = arith.mulf %x, %c : f32
    linalg.yield %0 : f32
  }} -> tensor<{b}x{l}x{s}xf32>"""
    return f"""
#q = affine_map<(b, i, j, d) -> (b, i, d)>
#kt = affine_map<(b, i, j, d) -> (b, d, j)>
#s = affine_map<(b, i, j, d) -> (b, i, j)>
#id3 = affine_map<(b, i, j) -> (b, i, j)>
#row = affine_map<(b, i, j) -> (b, i)>
#e = affine_map<(b, i, e, j) -> (b, i, j)>
#v = affine_map<(b, i, e, j) -> (b, j, e)>
#o = affine_map<(b, i, e, j) -> (b, i, e)>
func.func @main(%q: tensor<{b}x{l}x{d}xf32>, %k: tensor<{b}x{s}x{d}xf32>, %v: tensor<{b}x{s}x{e}xf32>)
    -> (tensor<{b}x{l}x{e}xf32>, tensor<{b}x{l}xf32>) {{
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %ekt = tensor.empty() : tensor<{b}x{d}x{s}xf32>
  %kt = linalg.transpose ins(%k : tensor<{b}x{s}x{d}xf32>) outs(%ekt : tensor<{b}x{d}x{s}xf32>) permutation = [0, 2, 1]
  %es = tensor.empty() : tensor<{b}x{l}x{s}xf32>
  %fs = linalg.fill ins(%zero : f32) outs(%es : tensor<{b}x{l}x{s}xf32>) -> tensor<{b}x{l}x{s}xf32>
  %s = linalg.generic {{indexing_maps = [#q, #kt, #s], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%q, %kt : tensor<{b}x{l}x{d}xf32>, tensor<{b}x{d}x{s}xf32>) outs(%fs : tensor<{b}x{l}x{s}xf32>) {{
  ^bb0(%a: f32, %bb: f32, %acc: f32):
    %0 = arith.mulf %a, %bb : f32
    %1 = arith.addf %acc, %0 : f32
    linalg.yield %1 : f32
  }} -> tensor<{b}x{l}x{s}xf32>{scale_op}{scores_reader_extra}
  %er = tensor.empty() : tensor<{b}x{l}xf32>
  %fm = linalg.fill ins(%ninf : f32) outs(%er : tensor<{b}x{l}xf32>) -> tensor<{b}x{l}xf32>
  %m = linalg.generic {{indexing_maps = [#id3, #row], iterator_types = ["parallel", "parallel", "reduction"]}}
      ins({scaled} : tensor<{b}x{l}x{s}xf32>) outs(%fm : tensor<{b}x{l}xf32>) {{
  ^bb0(%x: f32, %acc: f32):
    %0 = arith.maximumf %x, %acc : f32
    linalg.yield %0 : f32
  }} -> tensor<{b}x{l}xf32>
  %ex = linalg.generic {{indexing_maps = [#id3, #row, #id3], iterator_types = ["parallel", "parallel", "parallel"]}}
      ins({scaled}, %m : tensor<{b}x{l}x{s}xf32>, tensor<{b}x{l}xf32>) outs(%es : tensor<{b}x{l}x{s}xf32>) {{
  ^bb0(%x: f32, %mx: f32, %o: f32):
    %0 = arith.subf %x, %mx : f32
    %1 = math.exp %0 : f32
    linalg.yield %1 : f32
  }} -> tensor<{b}x{l}x{s}xf32>
  %fl = linalg.fill ins(%zero : f32) outs(%er : tensor<{b}x{l}xf32>) -> tensor<{b}x{l}xf32>
  %l = linalg.generic {{indexing_maps = [#id3, #row], iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%ex : tensor<{b}x{l}x{s}xf32>) outs(%fl : tensor<{b}x{l}xf32>) {{
  ^bb0(%x: f32, %acc: f32):
    %0 = arith.addf %x, %acc : f32
    linalg.yield %0 : f32
  }} -> tensor<{b}x{l}xf32>
  %eo = tensor.empty() : tensor<{b}x{l}x{e}xf32>
  %fo = linalg.fill ins(%zero : f32) outs(%eo : tensor<{b}x{l}x{e}xf32>) -> tensor<{b}x{l}x{e}xf32>
  %out = linalg.generic {{indexing_maps = [#e, #v, #o], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%ex, %v : tensor<{b}x{l}x{s}xf32>, tensor<{b}x{s}x{e}xf32>) outs(%fo : tensor<{b}x{l}x{e}xf32>) {{
  ^bb0(%a: f32, %bb: f32, %acc: f32):
    %0 = arith.mulf %a, %bb : f32
    %1 = arith.addf %acc, %0 : f32
    linalg.yield %1 : f32
  }} -> tensor<{b}x{l}x{e}xf32>
  return %out, %l : tensor<{b}x{l}x{e}xf32>, tensor<{b}x{l}xf32>
}}
"""


def torch_attention(q, k, v, scale: float = 1.0):
    """(E V, l) with E = exp(S - max_j S), S = scale Q K^T: what the payload computes."""
    import torch

    s = scale * (q @ k.transpose(-1, -2))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e @ v, e.sum(-1)
