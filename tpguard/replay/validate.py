"""Checks of a dump's replay context and sampling parameters, made where the dump is read.

Every field replay uses is checked for its type and range, so a corrupt or foreign value is a bad
dump (one line naming the field, exit 2), never an exception deep in a re-run (exit 5) and never a
verdict drawn from parameters no run can have (temperature 0, top_p outside (0, 1], renorm stages
that disagree with the parameters). Fields replay does not use are left alone (later writers may
add some).
"""

from __future__ import annotations

import json
import math

import torch

from tpguard.dump import PARAM_NAMES, PARAM_PREFIX, RENORM_STAGES

MAX_TREE_NODES = 1 << 16  # draft nodes per request: SGLang's trees have tens; the tree is built in Python
MAX_COIN_DIMS = 8
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INT_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")


class BadField(ValueError):
    """A field of a dump (`context.accept.threshold_single`, `param.top_p`) and what is wrong with it."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field} {why}")


def show(v) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _obj(v, field: str, what: str = "an object") -> dict:
    if not isinstance(v, dict):
        raise BadField(field, f"is {show(v)}, expected {what}")
    return v


def _str(d: dict, key: str, field: str, nullable: bool = False) -> None:
    if key in d and not (isinstance(d[key], str) or (nullable and d[key] is None)):
        raise BadField(f"{field}.{key}", f"is {show(d[key])}, expected a string" + (" or null" if nullable else ""))


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prod(shape) -> int:
    return math.prod(int(s) for s in shape)


def check_context(ctx, entries: dict[str, tuple[str, list[int]]]) -> None:
    """Raise BadField for the first field of `ctx` (the dump's parsed context) replay cannot use."""
    ctx = _obj(ctx, "context")
    _str(ctx, "algo", "context")
    parents = ctx.get("tree_parents")
    if parents is not None:  # null: the writer had no tree (DumpContext's default)
        if not isinstance(parents, list) or not 1 <= len(parents) <= MAX_TREE_NODES:
            raise BadField("context.tree_parents", f"is {show(parents)}, expected a list of 1 to "
                                                   f"{MAX_TREE_NODES} parent indices")
        for k, p in enumerate(parents):
            ok = p == -1 if k == 0 else _int(p) and 0 <= p < k
            if not (_int(p) and ok):
                raise BadField(f"context.tree_parents[{k}]", f"is {show(p)}, expected "
                               + ("-1 (the root)" if k == 0 else f"an earlier node's index in [0, {k})"))
    probs = _obj(ctx.get("probs", {}), "context.probs")
    _str(probs, "path", "context.probs")
    if "stages" in probs:
        stages = probs["stages"]
        if not isinstance(stages, list) or not all(isinstance(s, str) for s in stages):
            raise BadField("context.probs.stages", f"is {show(stages)}, expected a list of renorm stage names")
        for s in stages:
            if s not in RENORM_STAGES:
                raise BadField("context.probs.stages", f"has an unknown renorm stage {s!r} "
                                                       f"(known: {', '.join(RENORM_STAGES)})")
        # the backends apply them in this order whatever the list says: another order would
        # name the wrong kernel when the stages are re-run one at a time
        if stages != [s for s in RENORM_STAGES if s in stages]:
            raise BadField("context.probs.stages", f"is {show(stages)}, expected each stage at most once, in the "
                                                   f"order {', '.join(RENORM_STAGES)}")
    renorm = _obj(ctx.get("renorm", {}), "context.renorm", "an object {name, source, deterministic}")
    _str(renorm, "name", "context.renorm")
    _str(renorm, "source", "context.renorm", nullable=True)
    if renorm.get("deterministic") not in (None, True, False):
        raise BadField("context.renorm.deterministic", f"is {show(renorm['deterministic'])}, expected true, "
                                                       "false or null")
    coins = _obj(ctx.get("coins", {}), "context.coins", "an object {draw, shapes}")
    if coins.get("draw", "torch.rand") != "torch.rand":  # the only draw replay knows how to redo
        raise BadField("context.coins.draw", f"is {show(coins['draw'])}, expected \"torch.rand\"")
    if "shapes" in coins:
        _check_coin_shapes(coins["shapes"], entries)
    accept = _obj(ctx.get("accept", {}), "context.accept", "an object {threshold_single, threshold_acc}")
    for key in ("threshold_single", "threshold_acc"):
        v = accept.get(key, 1.0)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1):
            raise BadField(f"context.accept.{key}", f"is {show(v)}, expected a number in [0, 1]")
    _str(ctx, "device", "context")
    versions = _obj(ctx.get("versions", {}), "context.versions")
    for k, v in versions.items():
        if not (v is None or isinstance(v, str)):
            raise BadField(f"context.versions.{k}", f"is {show(v)}, expected a version string")


def _check_coin_shapes(shapes, entries) -> None:
    field = "context.coins.shapes"
    if not isinstance(shapes, list) or not all(
            isinstance(s, list) and len(s) <= MAX_COIN_DIMS and all(_int(x) and x >= 0 for x in s) for s in shapes):
        raise BadField(field, f"is {show(shapes)}, expected a list of shapes (lists of sizes >= 0)")
    if "coins" in entries:  # redrawing more than was recorded would only allocate, then fail
        want, got = _prod(entries["coins"][1]), sum(_prod(s) for s in shapes)
        if want != got:
            raise BadField(field, f"{show(shapes)} draw {got} coins, the dump records {want}")


# param name -> (the condition a row's value must meet, as said in the message)
_PARAM_RANGES = {
    "temperature": (lambda t: torch.isfinite(t) & (t > 0), "> 0 and finite"),
    "top_p": (lambda t: (t > 0) & (t <= 1), "in (0, 1]"),
    "min_p": (lambda t: (t >= 0) & (t <= 1), "in [0, 1]"),
    "top_k": (lambda t: t >= 0, ">= 0 (0: off)"),
}


def check_params(dump, ctx: dict | None) -> None:
    """Raise BadField for sampling parameters no run can have, or that the renorm stages contradict.

    `dump`: a reader.RankDump (its index, and its parameter tensors, read here: one value a row)."""
    logits = dump.entries.get("target_logits")
    rows = _prod(logits[1][:-1]) if logits and logits[1] else None
    vocab = logits[1][-1] if logits and logits[1] else None
    values = {}
    for name in PARAM_NAMES:
        key = PARAM_PREFIX + name
        if not dump.has(key):
            continue  # absent: the renorm re-run says it cannot run
        dtype, shape = dump.entries[key]
        if dtype not in (INT_DTYPES if name == "top_k" else FLOAT_DTYPES):
            raise BadField(key, f"is of dtype {dtype}, expected " + ("an integer" if name == "top_k" else "a float"))
        if rows is not None and _prod(shape) != rows:
            raise BadField(key, f"holds {_prod(shape)} values, target_logits {rows} rows: one value a row")
        t = dump.tensor(key).reshape(-1)
        t = t.to(torch.int64) if name == "top_k" else t.to(torch.float64)
        cond, text = _PARAM_RANGES[name]
        bad = (~cond(t)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise BadField(key, f"is {t[i].item()} on row {i} ({bad.numel()} of {t.numel()} rows), expected {text}")
        values[name] = t
    probs = (ctx or {}).get("probs") or {}
    if probs.get("path", "dense") != "dense" or "stages" not in probs:
        return
    stages = probs["stages"]
    # a row asking for a renorm the stages do not apply would be re-run without it
    asks = {"top_p": ("top_p" in values and values["top_p"] < 1, "below 1"),
            "top_k": ("top_k" in values and vocab is not None and (values["top_k"] > 0) & (values["top_k"] < vocab),
                      f"in [1, {vocab})")}
    for stage, (mask, what) in asks.items():
        if stage not in stages and mask is not False and bool(mask.any()):
            raise BadField("context.probs.stages", f"is {show(stages)}, with no {stage} stage, yet param.{stage} is "
                           f"{what} on {int(mask.sum())} of {mask.numel()} rows: the stages and the parameters "
                           "disagree")
