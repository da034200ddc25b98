"""Re-running one stage of the verify step on inputs every rank agreed on, many times.

Stages (the ones that produce a quantity from earlier ones):

* ``renorm``: target_logits -> target_probs: ``softmax(logits / temperature)`` in float32, then
  the renorm stages the batch needed (top_k, top_p, min_p, in that order) with the recorded
  per-row parameters, through the renorm registry (tpguard/renorm_registry.py), so the
  very functions the run called;
* ``coins``: rng_state -> coins: the first ``torch.rand`` draws of a generator set to the state;
* ``accept``: draft_tokens, target_probs, coins -> accept_index, accept_len, bonus, commit_lens,
  out_tokens: the accept step of launch/accept.py (DFlash chain or EAGLE tree, as recorded).

`repeat` calls a stage N times and compares every call with the first call and with each rank's
recorded bytes: whole tensors, and row by row where the ranks' rows differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DECISIONS = ("accept_index", "accept_len", "bonus", "commit_lens", "out_tokens")

Stage = Callable[[], dict[str, torch.Tensor]]


class StageUnavailable(RuntimeError):
    """The stage cannot run here (a backend or device missing); one line."""


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def row_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [rows]: whether each row of a and b holds the same bytes (NaN included)."""
    ia = a.contiguous().reshape(a.shape[0], -1).view(torch.uint8)
    ib = b.contiguous().reshape(b.shape[0], -1).view(torch.uint8)
    return (ia == ib).all(dim=1)


# --- the stages ------------------------------------------------------------------------------

def renorm_backend(name: str, device: str):
    """The renorm registry's backend of that name on `device`, or StageUnavailable."""
    from tpguard.renorm_registry import BackendUnavailable, get_backend

    try:
        return get_backend(name, device)
    except BackendUnavailable as e:
        raise StageUnavailable(str(e)) from None


def kernel_label(backend, kind: str) -> str:
    if backend.name.startswith("flashinfer") and kind != "min_p":
        det = " (is_deterministic=True)" if backend.name == "flashinfer-det" else ""
        return f"flashinfer {kind}_renorm_probs{det}"
    fn = getattr(backend, kind)
    return f"{backend.name} {getattr(fn, '__name__', kind)}"


def stage_param(kind: str, params: dict[str, torch.Tensor], vocab: int) -> torch.Tensor:
    if kind == "top_k":  # 0 (off) means every entry, as the pipeline and SGLang pass it
        k = params["top_k"]
        return torch.where(k > 0, k, torch.full_like(k, vocab))
    return params[kind]


def target_probs(logits: torch.Tensor, params: dict[str, torch.Tensor], stages: list[str], backend,
                 upto: int | None = None) -> torch.Tensor:
    """temperature, softmax, then `stages[:upto]` with `backend` (the harness's own function)."""
    vocab = logits.shape[1]
    return backend.target_probs(logits, params["temperature"], {k: stage_param(k, params, vocab) for k in stages},
                                upto=upto)


def redraw_coins(rng_state: torch.Tensor, shapes: list[list[int]], device: str) -> torch.Tensor:
    """The `torch.rand` draws of `shapes`, in order, from a generator set to `rng_state`, flattened
    and concatenated (one draw: its flat values)."""
    g = torch.Generator(device=device)
    try:
        g.set_state(rng_state.cpu())
    except (RuntimeError, TypeError) as e:
        raise StageUnavailable(f"the recorded rng_state is not a {device} generator's state "
                               f"({' '.join(str(e).split())[:120]}): replay with the run's --device") from None
    return torch.cat([torch.rand(shape, generator=g, device=device).reshape(-1) for shape in shapes])


def coins_matrix(coins: torch.Tensor, bs: int, nodes: int) -> torch.Tensor:
    """[bs, nodes + 1] (the last column the bonus coin) from the harness's [bs, nodes + 1] or the
    plugin's flat layout (bs * nodes coins, then bs bonus coins)."""
    if coins.dim() == 2 and tuple(coins.shape) == (bs, nodes + 1):
        return coins.float()
    if coins.numel() == bs * (nodes + 1):
        flat = coins.reshape(-1).float()
        return torch.cat([flat[: bs * nodes].view(bs, nodes), flat[bs * nodes:].view(bs, 1)], dim=1)
    raise StageUnavailable(f"coins of shape {list(coins.shape)} do not fit {bs} requests x {nodes} nodes")


def accept_step(draft_tokens: torch.Tensor, probs: torch.Tensor, coins: torch.Tensor, parents: list[int],
                algo: str, threshold_single: float = 1.0, threshold_acc: float = 1.0) -> dict[str, torch.Tensor]:
    """The harness's accept step (launch/pipeline.py, after the coins): the decision tensors."""
    from tpguard.launch.accept import bonus_tokens, output_tokens, verify_target_only
    from tpguard.launch.tree import from_parents

    tree = from_parents(algo, list(parents))
    if draft_tokens.dim() != 2:
        raise StageUnavailable(f"draft_tokens of shape {list(draft_tokens.shape)} are not [requests, nodes]")
    bs, n = draft_tokens.shape
    if n != tree.nodes:
        raise StageUnavailable(f"draft_tokens has {n} nodes per request, the recorded tree {tree.nodes}")
    if probs.numel() % (bs * n):
        raise StageUnavailable(f"target_probs of shape {list(probs.shape)} do not fit {bs} x {n} rows")
    c = coins_matrix(coins, bs, n)
    res = verify_target_only(draft_tokens, tree, c[:, :n], c[:, n], probs.reshape(bs, n, -1),
                             threshold_single, threshold_acc)
    bonus = bonus_tokens(res.predicts, res.accept_index, res.accept_len)
    return {"accept_index": res.accept_index, "accept_len": res.accept_len, "bonus": bonus,
            "commit_lens": res.accept_len + 1,
            "out_tokens": output_tokens(draft_tokens, res.accept_index, res.accept_len, bonus)}


# --- repeating a stage ----------------------------------------------------------------------

@dataclass
class Repeat:
    """N calls of one stage on one input."""

    label: str
    backend: str
    role: str  # "run" (the backend the run used), "deterministic" (a fix candidate), "kernel", "stage"
    calls: int = 0
    differing: int = 0  # calls whose output differs from the first call's
    reproduced_by: dict[str, int | None] = field(default_factory=dict)  # rank -> first call giving its bytes
    rows_reproduced: dict[str, dict[str, int | None]] = field(default_factory=dict)  # rank -> row -> call
    matches_agreed_rows: bool | None = None  # every row the ranks agreed on came out of some call
    outputs_reproduced: dict[str, dict[str, int | None]] = field(default_factory=dict)  # rank -> name -> call
    error: str | None = None
    seconds: float = 0.0

    @property
    def deterministic(self) -> bool:
        return self.error is None and self.calls > 0 and self.differing == 0

    def ranks_reproduced(self) -> list[int]:
        """Ranks whose recorded value came out of some call: whole, or every differing row."""
        out = []
        for r, call in self.reproduced_by.items():
            rows = self.rows_reproduced.get(r)
            if call is not None or (rows and all(c is not None for c in rows.values())):
                out.append(int(r))
        return sorted(out)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["deterministic"] = self.deterministic
        d["ranks_reproduced"] = self.ranks_reproduced()
        return d


def repeat(label: str, backend: str, role: str, stage: Stage, calls: int,
           recorded: dict[int, dict[str, torch.Tensor]], rows_of: str | None = None,
           differing_rows: list[int] | None = None) -> Repeat:
    """Call `stage` `calls` times; compare with the first call and each rank's recorded outputs.

    recorded: rank -> {name: tensor on the stage's device}; rows_of: the output compared row by
    row on `differing_rows` (the rows where the ranks differ) and on the rows they agree on."""
    rep = Repeat(label, backend, role)
    ranks = sorted(recorded)
    rep.reproduced_by = {str(r): None for r in ranks}
    rep.outputs_reproduced = {str(r): {k: None for k in recorded[r]} for r in ranks}
    rows_idx = None
    if rows_of is not None and differing_rows is not None:
        rep.rows_reproduced = {str(r): {str(x): None for x in differing_rows} for r in ranks}
        any_rec = recorded[ranks[0]][rows_of]
        rows_idx = torch.tensor(differing_rows, dtype=torch.long, device=any_rec.device)
        agreed = torch.ones(any_rec.shape[0], dtype=torch.bool, device=any_rec.device)
        agreed[rows_idx] = False
        agreed_seen = torch.zeros_like(agreed)
    first = None
    t0 = time.perf_counter()
    try:
        for call in range(1, calls + 1):
            out = stage()
            rep.calls = call
            if first is None:
                first = out
            elif any(not same_bytes(out[k], first[k]) for k in first):
                rep.differing += 1
            if rows_idx is not None and rows_of in out:
                rec, o = recorded[ranks[0]][rows_of], out[rows_of]
                if o.shape == rec.shape and o.dtype == rec.dtype:
                    agreed_seen |= row_bytes_equal(o, rec) & agreed
            for r in ranks:
                rec = recorded[r]
                hits = {k: k in out and same_bytes(out[k], t) for k, t in rec.items()}
                for k, hit in hits.items():
                    if hit and rep.outputs_reproduced[str(r)][k] is None:
                        rep.outputs_reproduced[str(r)][k] = call
                if rep.reproduced_by[str(r)] is None and all(hits.values()):
                    rep.reproduced_by[str(r)] = call
                if rows_idx is not None and rows_of in out and out[rows_of].shape == rec[rows_of].shape:
                    same = row_bytes_equal(out[rows_of][rows_idx], rec[rows_of][rows_idx]).tolist()
                    seen = rep.rows_reproduced[str(r)]
                    for row, hit in zip(differing_rows, same):
                        if hit and seen[str(row)] is None:
                            seen[str(row)] = call
    except StageUnavailable as e:
        rep.error = str(e)
    except Exception as e:  # noqa: BLE001 - a backend failing on this input is a finding, not a crash
        rep.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if rep.error is not None:
        rep.calls = 0
    elif rows_idx is not None and rep.calls:
        rep.matches_agreed_rows = bool((agreed_seen | ~agreed).all())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rep.seconds = time.perf_counter() - t0
    return rep
