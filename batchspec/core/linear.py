"""The lean forward's linear layers: one matrix product per linear (or per group of linears that
read the same input), run by the kernel the machine's plan measured fastest for its token count
(`core/kernels.py`), and transformers' RMSNorm without its module call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import ONEDNN, Plan, w_xt

MM_EVERYWHERE = Plan.everywhere(mm=True)  # `matmul`'s default: W @ x^T up to kernels.COUNTS[-1] tokens
VIEW_ROWS = 16  # from this many tokens on, the gate/up product's output is left transposed (see `matmul`)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           plan: Plan = MM_EVERYWHERE, contiguous: bool = True, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias, as `F.linear`, as W @ x^T or through oneDNN on `packed` (the weight laid
    out for it, `kernels.ONEDNN`; without it, F.linear), over x's rows or more, as `plan` says for
    x's token count.

    Decoding feeds a linear 1 to ~32 tokens. On some CPUs in float32 `F.linear` then runs a
    matrix-vector product (one token) or a GEMM with a transposed, skinny operand far below what
    the memory bus allows, and W [out, in] @ x^T [in, M], which reads the weight in its stored
    order, runs 2-3x faster; on others it is the other way round; and either may run a count it
    is not blocked for slower than a larger one (`core/kernels.py` has the numbers and measures
    which holds where it runs: a lean forward passes the plan it measured). Zero rows added to x
    are computed and dropped. bfloat16/float16 and other devices keep `F.linear`.

    W @ x^T comes out as [out, tokens]: its transpose is a view, which `contiguous` copies into
    [tokens, out] order. A caller that only adds the output to the residual stream (o_proj, down)
    or multiplies it elementwise (gate/up) takes the view (`contiguous=False`): the elementwise
    op reads it as it is, and a product of SiLU(gate) x up keeps its [out, tokens] order, which
    the down projection then reads as W @ x^T without a transpose. Measured through the runner,
    the bundled target on the EPYC, speed without the copies over with them (medians of 30
    alternations): 1.06-1.10x for a step of 16-64 rows, 1.04-1.09x verifying 8-32 rows of 2-5
    tokens, 1.11-1.12x a one-row prefill of 64-256 tokens (a refill; above 256 tokens F.linear
    runs, unchanged). Below 16 tokens a down projection reading gate/up's transposed order ran
    slower (0.83-0.94x at 2-8 tokens), so there gate/up's output is copied (`VIEW_ROWS`) and only
    the o_proj and down outputs stay views: 0.99-1.04x.

    Example: x [3, 384], weight [640, 384], plan.fed[3] = 4, 3 in plan.mm -> x with a zero row
    [4, 384] -> mm(weight, x^T) [640, 4] -> its first 3 columns, transposed [3, 640]."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < rows < len(plan.fed):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    fed = plan.fed[rows]
    if fed > rows:  # a real copy: a stride-0 operand is slow again
        flat = torch.cat((flat, flat.new_zeros(fed - rows, flat.shape[1])))
    if rows in plan.mm:
        out = w_xt(flat, weight)[:, :rows].t()  # [out, fed] -> [rows, out]
        if contiguous:
            out = out.contiguous()
        if bias is not None:
            out += bias
    elif rows in plan.dnn and packed is not None:
        out = ONEDNN.run(flat, packed, bias)[:rows]
    else:
        out = F.linear(flat, weight, bias)[:rows]  # the first rows: contiguous
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear:
    """A linear module as the lean forward runs it: its weight as the module holds it now (it
    follows `model.to(...)`), and the copy of it laid out for oneDNN where the plan takes that
    kernel at some count (`pack`; made again when the forward re-fuses)."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module, self.plan, self.packed = module, MM_EVERYWHERE, None

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    def pack(self, plan: Plan) -> None:
        self.plan = plan
        self.packed = ONEDNN.pack(self.weight) if plan.dnn else None

    def __call__(self, x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        return matmul(x, self.module.weight, self.module.bias, self.plan, contiguous, self.packed)


class FusedLinear:
    """Linears that read the same input (q/k/v, gate/up) as one matrix product.

    The modules' own weights become views into the fused weight, so memory is not doubled and the
    transformers path keeps working on the same numbers (the copy laid out for oneDNN, where the
    plan takes it, is a second copy)."""

    def __init__(self, *linears: torch.nn.Linear) -> None:
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            self.bias = None
            if any(lin.bias is not None for lin in linears):
                self.bias = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                                       for lin in linears])
            self.sizes = [lin.out_features for lin in linears]
            self.plan, self.packed = MM_EVERYWHERE, None  # set by the lean forward (`pack`, `core/kernels.py`)
            offset = 0
            for lin, size in zip(linears, self.sizes):
                lin.weight = torch.nn.Parameter(self.weight[offset:offset + size], lin.weight.requires_grad)
                if lin.bias is not None:
                    lin.bias = torch.nn.Parameter(self.bias[offset:offset + size], lin.bias.requires_grad)
                offset += size
        # (parameter dict, data pointer) of each module's weight view: `LeanForward.stale` compares
        # them. A dict lookup, not `lin.weight`, which goes through Module.__getattr__ (slower).
        self.watch = [(lin._parameters, lin.weight.data_ptr()) for lin in linears]

    pack = Linear.pack

    def __call__(self, x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        """All outputs side by side: [..., sum of out_features]."""
        return matmul(x, self.weight, self.bias, self.plan, contiguous, self.packed)


class RMSNorm:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, module) -> None:
        self.weight, self.eps = module.weight, module.variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
