#!/usr/bin/env python3
"""Diagnostic for the known defect of issue 5: capturing the autograd backward of
dsaib.torch.indexer_kl_loss in torch.cuda.graph. Runs variants of one capture and
prints, for each, "ok" or the exception: which ingredient triggers
cudaErrorStreamCaptureImplicit. Needs a CUDA GPU and the dsaib package (cuda).

  python3 scripts/device/diagnose_autograd_capture.py
"""
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python", "tests"))
import dsaib.torch as dt  # noqa: E402
from torch_reference import make_torch_problem, warm_up_on_side_stream  # noqa: E402

DEV = "cuda"


def capture(name, step, mode="global"):
    try:
        step()  # eager
        warm_up_on_side_stream(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            step()
        graph.replay()
        torch.cuda.synchronize()
        print(f"{name:58s} ok")
    except Exception as e:  # noqa: BLE001 (a diagnostic: report and go on)
        msg = str(e).splitlines()[0][:150]
        print(f"{name:58s} FAILED: {type(e).__name__}: {msg}")
        tb = traceback.extract_tb(e.__traceback__)
        for fr in tb[-3:]:
            print(f"    at {os.path.basename(fr.filename)}:{fr.lineno} {fr.name}")
        torch.cuda.synchronize()


class PlainFunction(torch.autograd.Function):
    """Same shape of custom Function, torch ops only: is the engine itself the cause?"""

    @staticmethod
    def forward(ctx, q, w, k):
        ctx.save_for_backward(q, w, k)
        return (q.float().sum() + w.float().sum() + k.float().sum()) * 0.5

    @staticmethod
    def backward(ctx, g):
        q, w, k = ctx.saved_tensors
        return g * torch.ones_like(q), g * torch.ones_like(w), g * torch.ones_like(k)


def main():
    print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    q, w, k, ids, T = make_torch_problem(device=DEV, B=1, S=64, S_kv=128, H=64, D=128, topk=128, seed=12)
    g = torch.ones((), device=DEV)
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, w, k)]
        tag = "f32 leaves" if dtype == torch.float32 else "bf16 leaves"

        def grad_step():
            loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=0.1)
            return torch.autograd.grad(loss * g, leaves)

        def backward_step():
            for x in leaves:
                x.grad = None
            loss = dt.indexer_kl_loss(*leaves, ids, T, sm_scale=0.1)
            (loss * g).backward()

        def plain_step():
            return torch.autograd.grad(PlainFunction.apply(*leaves) * g, leaves)

        def op_only_step():
            P = dt.index_scores(*[x.detach() for x in leaves], ids, sm_scale=0.1)
            return dt.indexer_backward(*[x.detach() for x in leaves], ids, T, P, sm_scale=0.1, grad_loss=g)

        capture(f"{tag}: op only (indexer_backward)", op_only_step)
        capture(f"{tag}: plain torch autograd.Function + autograd.grad", plain_step)
        capture(f"{tag}: indexer_kl_loss + autograd.grad", grad_step)
        capture(f"{tag}: indexer_kl_loss + autograd.grad, thread_local", grad_step, "thread_local")
        capture(f"{tag}: indexer_kl_loss + autograd.grad, relaxed", grad_step, "relaxed")
        capture(f"{tag}: indexer_kl_loss + loss.backward()", backward_step)


if __name__ == "__main__":
    main()
