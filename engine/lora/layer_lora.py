"""The LoRA deltas of one decoder layer's linear layers, for the rows of a packed step.

Each adapted fused layer (qkv, gate_up, o, down) holds, per device slot, A^T [in, P R] (its
P checkpoint parts' A stacked, R = max_lora_rank, zero columns past a part's rank: one shrink
for all parts) and each part's scaled B^T [R, out_part] (its own expand, into its rows of the
output). The runner orders a step's rows by slot, so each adapter's tokens are runs of the
packed batch (segments). Small segments of a run of slots go through one batched matmul per
factor, padded to one length (engine/lora/segments.py plans it); the rest get their own
matmuls. Small matmuls cost their call more than their arithmetic: batching them is what
keeps many adapters in one decode step cheap.
"""

from __future__ import annotations

import torch

from engine.lora.segments import LoRAStep

# module -> (A^T [slots, in, P R], [(part, first output row, B^T [slots, R, rows]) per part])
ModuleWeights = tuple[torch.Tensor, list[tuple[str, int, torch.Tensor]]]


class LayerLoRA:
    """A layer's slots' weights, by fused module name ("self_attn.qkv_proj", ...)."""

    def __init__(self, step: LoRAStep, weights: dict[str, ModuleWeights]) -> None:
        self.step = step
        self.weights = weights

    def add(self, module: str, out: torch.Tensor, x: torch.Tensor, dim: int = 0) -> None:
        """out += the delta of each row's adapter on `x`, in place. dim 0: token-major
        (x [T, in], out [T, out]); dim 1: feature-major (x [in, T], out [out, T])."""
        step = self.step
        if not step.active or module not in self.weights:
            return
        a, all_parts = self.weights[module]
        r = a.shape[2] // len(all_parts)
        # Only the parts some adapter of the step adapts (the others' weights are zeros).
        parts = [(p, row, b) for p, (name, row, b) in enumerate(all_parts) if name in step.parts]
        if not parts:
            return
        if step.kernel is not None:  # the kernels read any strides: token-major views
            from engine.lora.triton_kernels import lora_expand, lora_shrink

            tm_x, tm_out = (x, out) if dim == 0 else (x.t(), out.t())
            shrunk = lora_shrink(tm_x, a, step.kernel)
            for p, row, b in parts:
                lora_expand(shrunk, b, tm_out, p * r, row, step.kernel)
            return
        batch = step.batched
        if batch is not None:
            lo, hi, m = batch.first_slot, batch.last_slot + 1, batch.length
            xs = x.index_select(dim, batch.gather)
            shrunk = torch.bmm((xs if dim == 0 else xs.t()).reshape(hi - lo, m, -1), a[lo:hi])
            for p, row, b in parts:
                n = b.shape[2]
                delta = torch.bmm(shrunk[:, :, p * r : (p + 1) * r], b[lo:hi])
                delta = delta.view((hi - lo) * m, n).index_select(0, batch.rows)
                if dim == 0:
                    target, source = out[:, row : row + n], delta
                else:  # a contiguous source: strided adds cost several times more here
                    target, source = out[row : row + n], step.transpose(delta)
                if batch.span is not None:
                    target.narrow(dim, batch.span[0], batch.span[1]).add_(source)
                else:
                    target.index_add_(dim, batch.tokens, source)
        # Outputs feature-major: a part's rows are then one contiguous slice.
        fm_out = out.t() if dim == 0 else out
        fm_x = x.t() if dim == 0 else x
        for slot, i, j in step.single:
            shrunk = a[slot].t() @ fm_x[:, i:j]  # [P R, tokens]
            for p, row, b in parts:
                target = fm_out[row : row + b.shape[2], i:j]
                target.addmm_(b[slot].t(), shrunk[p * r : (p + 1) * r])
