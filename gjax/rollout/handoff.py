"""What a weight push carries to a `gjax.serve` replica: the whole policy, or the adapters only.

Full fine-tuning pushes the whole params tree. A LoRA run (`model.lora.rank > 0`) pushes only
the adapters (`lora_a`, `lora_b` leaves: rank 16 on all 7 targets of the 1.5B shape is 1.2 %
of the bytes, `benchmarks/weight_push.py`); the server holds the base it loaded from its own
checkpoint and serves `lora.merge(base, adapters)`. Its decode step adds the adapters'
low-rank terms as the trainer's does (`transformer.decode_layers`: merged into bf16 kernels a
small update would round away; `benchmarks/lora_decode.py` times the two forms).

A `Handoff` is each side's description: `record` None (full weights) or
{"rank", "alpha", "targets", "quantize", "base_digest"} (`adapter_record`). The trainer's `payload(params)`
is what a push sends; the server's `like()` is the tree a push is restored onto and
`params_from(payload)` what it then serves. An adapter push names its record (the directory
version's `ADAPTER_META` file, the gRPC Spec's "adapters"), and a server whose record differs
(full weights, another rank, alpha or target list, another base content) refuses it by name
(`check`), as `HandoffMismatch`: a user's paragraph.
"""

from __future__ import annotations

from gjax.errors import UserError
from gjax.models import lora
from gjax.models.config import ModelConfig

ADAPTER_META = "gjax_adapters.json"  # in a push directory's version: the adapter record


class HandoffMismatch(UserError, ValueError):
    """A push whose kind (full / adapters) or adapter record is not the server's."""


def adapter_record(cfg: ModelConfig, base) -> dict | None:
    """The record of a LoRA run's pushes (None: full fine-tuning): the adapters' shape and the
    content hash of the base they apply to (`lora.base_digest`, the same however it is
    sharded, so the trainer's and a server's own load of one checkpoint agree)."""
    if not lora.enabled(cfg):
        return None
    return {
        "rank": int(cfg.lora_rank),
        "alpha": float(cfg.lora_alpha),
        "targets": list(cfg.lora_targets),
        "quantize": cfg.base_quant,
        "base_digest": lora.base_digest(base),
    }


def describe(record: dict | None) -> str:
    if record is None:
        return "full weights"
    return (
        f"LoRA adapters (rank {record['rank']}, alpha {record['alpha']:g}, targets "
        f"{','.join(record['targets'])}, base digest {record['base_digest'][:12]})"
    )


class Handoff:
    """One side of the hand-off. Trainer: `Handoff(record)`. Server: `Handoff(record, base)`,
    `base` the frozen params it loaded (None with full weights)."""

    def __init__(self, record: dict | None = None, base=None):
        self.record = record
        self.base = base

    @property
    def adapters(self) -> bool:
        return self.record is not None

    def payload(self, params):
        """What a push of `params` (the policy's whole tree) sends: the adapters alone with
        LoRA (a tree of only `lora_a` / `lora_b` leaves; idempotent), else `params`."""
        return lora.split(params)[1] if self.adapters else params

    def like(self, served):
        """The tree of `served` (the held params) that a push replaces."""
        return self.payload(served)

    def params_from(self, payload):
        """The params to serve from a push's `payload` (with the held base: no copy)."""
        return lora.merge(self.base, payload) if self.adapters else payload

    def check(self, record: dict | None, where: str) -> None:
        """Raises HandoffMismatch unless a push described by `record` fits this server."""
        if record == self.record:
            return
        mine, theirs = self.record or {}, record or {}
        if self.adapters and record is not None and mine.get("quantize") != theirs.get("quantize"):
            why = (
                f"the trainer's base is stored as quantize={theirs.get('quantize')!r}, this "
                f"server's as {mine.get('quantize')!r}: start gjax.serve with the trainer's "
                "model.lora.quantize"
            )
        elif (
            self.adapters
            and record is not None
            and mine.get("base_digest") != theirs.get("base_digest")
        ):
            why = (
                "its adapters were trained on another base (base digest "
                f"{theirs.get('base_digest', '?')[:12]}, this server's "
                f"{mine.get('base_digest', '?')[:12]}): start gjax.serve on the trainer's "
                "model.path"
            )
        else:
            why = (
                "start gjax.serve with the trainer's --config (the same model.path and "
                "model.lora.rank / alpha / targets)"
            )
        raise HandoffMismatch(
            f"{where} carries {describe(record)}, but this gjax.serve server takes "
            f"{describe(self.record)}: {why}."
        )
