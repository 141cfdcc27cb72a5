"""A process that cannot hold the plain step: the user's situation, on this CPU.

``python tests/_capped.py capped MODEL HEADROOM_BYTES`` builds MODEL, warms up what every
step needs (imports, kernels, the profiler's tracer, on a tiny model), then caps its own address
space (``RLIMIT_AS``) at what it maps now plus HEADROOM_BYTES, and runs, in turn:
- ``torch``: one step with torch's checkpoint on every block (the control: it should fit), its peak;
- ``floor``: ``remat.auto`` at a budget of 1 byte, which must be refused before any large step;
- ``every``, ``smallest``: ``remat.auto(verify=True)`` at torch's every-block peak and at the floor
  the refusal named, then three training steps with the plan;
- ``plain``: one plain training step (the control: it should run out of memory). It runs last:
  once a step has run out of memory, oneDNN may fail to create later convolutions in the process
  ("could not create a primitive"; the capped UNet, 3 runs in 11, with 73 MiB of the cap still free
  where torch's checkpoint needs 60).
``python tests/_capped.py train ZOO_MODEL HEADROOM_BYTES BUDGET OUT`` runs ``remat train`` so capped,
and ``python tests/_capped.py reference MODEL`` prints the hash of the plain step's gradients (no cap).
It prints one JSON line: what happened, the report's numbers, and how far the process's resident
set grew past the moment of the cap (``grown_bytes``, from ``VmHWM``). glibc returns freed large
blocks at once (``MALLOC_MMAP_THRESHOLD_``, set by the test that starts it), so what a step frees
is free again for the next. The cap counts every byte the process maps, the tensors and all else.
"""

from __future__ import annotations

import json
import resource
import sys
import traceback
from typing import Any

import torch
from torch import nn

# Modules the model runs more than once per step, which a user checkpoints by hand beside the blocks
# (torch's checkpoint on every call; NOTE [ Every call of a tied module ] in remat.measure.tied).
TIED = {"hf-albert": ["albert.encoder.albert_layer_groups.0"]}


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def build(name: str) -> tuple[nn.Module, Any, Any]:
    from remat import models

    torch.manual_seed(0)
    if name == "gpt":
        model = models.build_model(models.GPTConfig(n_layer=5, n_embd=128, n_head=4, block_size=256, vocab_size=256))
        return model, models.make_batch(model, batch_size=4, seq_len=256), models.loss_fn_for(model)
    if name == "unet":
        model = models.build_model(models.UNetConfig(image_size=64, channels=32))
        return model, models.make_batch(model, batch_size=8), models.loss_fn_for(model)
    if name == "hf-llama":  # a transformers model whose head's logits are the step's peak
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=16000, hidden_size=128, intermediate_size=512, num_hidden_layers=12,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 16000, (4, 256))
        return model, {"input_ids": ids, "labels": ids}, None
    if name == "hf-albert":  # one layer the model runs for every depth (weight-tied): no block
        import transformers

        cfg = transformers.AlbertConfig(vocab_size=1000, embedding_size=64, hidden_size=128, num_hidden_layers=12,
                                        num_attention_heads=4, intermediate_size=512, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
        model = transformers.AlbertForMaskedLM(cfg)
        ids = torch.randint(0, 1000, (4, 128))
        return model, {"input_ids": ids, "labels": ids}, None
    if name == "embedding":  # most weights in an embedding table, whose gradient is dense (NOTE [ Copies off the budget's memory ])
        model = _Embedded(vocab=65536, dim=128, depth=8)
        return model, torch.randint(0, 65536, (4, 512)), _square_mean
    raise SystemExit(f"unknown model {name}")


class _Embedded(nn.Module):
    """An embedding table of 32 MiB under eight small residual MLPs: weights larger than remat's own
    host memory, which copies of them once outgrew."""

    def __init__(self, vocab: int, dim: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return x


def _square_mean(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.square().mean()


def _warm_up() -> None:
    """What any step of any size needs mapped (code, kernels, the tracer), on a tiny model."""
    import remat
    from remat import models

    tiny = models.build_model(models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64))
    batch = models.make_batch(tiny, batch_size=2, seq_len=32)
    remat.auto(tiny, batch, "90%", loss_fn=models.loss_fn_for(tiny), repeats=1, verify=True)
    remat.remove(tiny)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
    conv(torch.randn(2, 3, 16, 16, requires_grad=True)).sum().backward()


def _torch_every_block(model: nn.Module, name: str) -> list[tuple[nn.Module, Any]]:
    """torch's checkpoint on every block remat finds and every module of ``TIED`` (the instance's
    forward; ``del`` undoes it)."""
    from torch.utils.checkpoint import checkpoint

    from remat.manual.blocks import find_blocks

    done = []
    for block in [b for _, b in find_blocks(model, None, required=False)] + [model.get_submodule(n) for n in TIED.get(name, [])]:
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        done.append((block, forward))
    return done


def digest(model: nn.Module, batch: Any, loss_fn: Any) -> dict[str, Any]:
    """One step's loss and gradients (the weights as they are): a hash, bit for bit, and each
    gradient's sum of squares, for plans that sum in another order (a chunked head, a tiled MLP)."""
    import hashlib

    from remat.measure import step as _step

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = _step.forward_loss(model, batch, _step.resolve_loss_fn(loss_fn))
    loss.backward()
    h = hashlib.sha256(loss.detach().numpy().tobytes())
    squares = [float(loss.detach())]
    for name, p in sorted(model.named_parameters()):
        if p.grad is not None:
            h.update(name.encode())
            h.update(p.grad.numpy())  # no copy: a copy of the largest gradient may not fit the cap
            squares.append(sum(float(piece.double().square().sum()) for piece in p.grad.reshape(-1).split(2**18)))
    model.zero_grad(set_to_none=True)
    return {"hash": h.hexdigest(), "squares": squares}


def main() -> None:
    mode, name = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode == "reference":  # the plain step's gradients, in a process that holds it
        print("RESULT " + json.dumps({"digest": digest(*build(name))}), flush=True)
        return
    headroom = int(sys.argv[3])
    _warm_up()
    if mode == "capped":
        model, batch, loss_fn = build(name)
    else:  # the zoo model and global batch ``remat train`` will train, for the control
        from remat.models.zoo import build as zoo_build

        model, batch, loss_fn = zoo_build(name, batch_size=16, seq_len=128)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cap = _vm("VmSize") + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    out: dict[str, Any] = {"model": name, "headroom": headroom}
    for scenario in (("train", "plain") if mode == "train" else ("torch", "floor", "every", "smallest", "plain")):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here: this scenario's own high-water mark
        rss = _vm("VmRSS")
        model.load_state_dict(initial)
        try:
            out[scenario] = {"ok": True, **_run(scenario, model, batch, loss_fn, out)}
        except Exception as e:  # the scenario's outcome, reported to the test
            out[scenario] = {"ok": False, "error": type(e).__name__, "message": str(e)[:2000],
                             "trace": traceback.format_exc()[-3000:]}
        out[scenario]["grown_bytes"] = _vm("VmHWM") - rss
    print("RESULT " + json.dumps(out), flush=True)


def _run(scenario: str, model: Any, batch: Any, loss_fn: Any, done: dict[str, Any]) -> dict[str, Any]:
    import remat
    from remat.measure import step as _step
    from remat.measure.step_memory import measure_step

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no state: the controls and plans alike
    if scenario == "plain":  # the control: the plain step does not fit
        _step.train_step(model, batch, _step.resolve_loss_fn(loss_fn), opt)
        return {}
    if scenario == "torch":  # the control: torch's checkpoint on every block fits
        forwards = _torch_every_block(model, sys.argv[2])
        try:
            return {"peak_bytes": measure_step(model, batch, loss_fn=loss_fn, optimizer=opt, repeats=0).peak_bytes}
        finally:
            for block, _ in forwards:
                del block.forward
    if scenario == "floor":  # a budget below the floor is refused before a large step runs
        try:
            remat.auto(model, batch, 1, loss_fn=loss_fn, optimizer=opt, repeats=1)
        except remat.InfeasibleBudget as e:
            return {"refused": True, "smallest_bytes": e.smallest_bytes, "text": str(e)}
        return {"refused": False}
    if scenario in ("every", "smallest"):
        budget = done["torch"]["peak_bytes"] if scenario == "every" else done["floor"]["smallest_bytes"]
        refined = None
        try:
            plan, report = remat.auto(model, batch, budget, loss_fn=loss_fn, optimizer=opt, repeats=1, verify=True)
        except remat.InfeasibleBudget as e:
            # The floor a refusal names before any step ran is the fake tensors' bytes; the lean
            # steps then measure what kernels allocate besides (NOTE [ What no tensor holds ]),
            # and the next refusal names the floor with it.
            if scenario != "smallest" or e.smallest_bytes is None or e.smallest_bytes <= budget:
                raise
            budget = refined = e.smallest_bytes
            plan, report = remat.auto(model, batch, budget, loss_fn=loss_fn, optimizer=opt, repeats=1, verify=True)
        grads = digest(model, batch, loss_fn)
        fn = _step.resolve_loss_fn(loss_fn)
        losses = [float(_step.train_step(model, batch, fn, opt)) for _ in range(3)]
        remat.remove(model)
        return {"budget": budget, "plan": plan.to_json(), "report": json.loads(report.to_json()), "losses": losses,
                "digest": grads, "refined_from": done["floor"]["smallest_bytes"] if refined else None}
    if scenario == "train":
        from click.testing import CliRunner

        from remat.cli.commands import main as cli

        args = ["train", "--model", sys.argv[2], "--budget", sys.argv[4], "--steps", "3", "--global-batch", "16",
                "--seq", "128", "--eval-every", "0", "--checkpoint-every", "0", "--device", "cpu",
                "--out", sys.argv[5]]
        result = CliRunner().invoke(cli, args, catch_exceptions=True)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return {"exit_code": result.exit_code, "output": result.output[-3000:]}
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main()
