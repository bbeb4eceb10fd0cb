"""Validated, frozen settings. Every other module takes one of these instead of loose keyword arguments.

`LynxQuantConfig` fixes the KV codec (which method, which anchor design, alpha, C, page size, axes);
`SpecConfig` fixes the draft/verify loop. A config is hashable and cheap to compare, so a peer can refuse a
mismatch at the handshake (see `to_dict`/`from_dict`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError

METHODS = ("lynx", "paper", "bf16", "int8", "kivi4", "kivi3", "kivi2", "cachegen", "identity")
ANCHORS = ("centroid", "center", "paper")
AXES = ("auto", "channel", "token")
ANCHOR_BITS = (2, 3, 4)
AUTO = "auto"  # anchor_bits chosen per request (lynx_hf.width)
CONFIG_NAME = "lynx_config.json"


@dataclass(frozen=True)
class LynxQuantConfig:
    """The KV codec.

    method:     "lynx" (offset-binary companded code, the default), "paper" (sign-magnitude α-law, as published),
                or a baseline with the same API: "bf16", "int8", "kivi4", "kivi3", "kivi2", "cachegen" (CacheGen:
                per-token quantization with depth-dependent bins, then arithmetic coding; quant/cachegen.py),
                "identity" (lossless passthrough).
    alpha:      α of the α-law compander y = ln(1+α|u|)/ln(1+α); 0 means linear.
    chunk_size: C, tokens per chunk for the μ/σ outlier-isolation stage when that stage runs along channels.
    page_size:  tokens per page for the per-channel γ normalisation ("paper" only: in "lynx" the chunk μ/σ are
                fp16 and a page stage would add bits and no precision).
    key_axis / value_axis: direction of the chunk stage: "channel" (C tokens of one channel share μ/σ),
                "token" (the D channels of one token share μ/σ) or "auto" (chosen per tensor from its outlier
                structure, see quant.lynx.choose_axis; keys come out "channel", values mostly "token").
    anchor:     how an anchor is reconstructed alone: "center" (its grid point, default), "centroid"
                (mean of its fine cells) or "paper" (code 16a+7 at 4 bits, the published +7 bias).
    anchor_bits: "lynx" / "paper": the anchor's width b ∈ {2, 3, 4} (default 4): the anchor stream carries the top b
                bits of the 8-bit code, the residual the other 8 − b (the full tier is 8 bits at every width; "lynx"
                nests its code so that the b-bit anchor is itself a rounded b-bit code: quant/tables.py). A narrower
                anchor reaches the decode side sooner and drafts on coarser KV (docs/codec.md gives its KL).
                "auto": chosen per request from the link's rate, the prompt's length and the drafts each width
                keeps (lynx_hf.width, docs/drafting.md "Anchor width"); the codec itself takes a resolved width.
    group_size: group of the uniform baselines (KIVI: tokens per channel group for keys, channels for values).
    exact:      "lynx" / "paper" only: a third, lowest-priority stream carries the correction from the 8-bit
                reconstruction to the KV's own bits (quant/exact.py), so the full tier is the model's KV bit for bit
                and decoding equals plain `generate` with a DynamicCache in the same dtype. Default False: the full
                tier is the 8-bit code (INT8-grade: docs/drafting.md gives its KL and agreement with BF16).
    """

    method: str = "lynx"
    alpha: float = 0.5
    chunk_size: int = 64
    page_size: int = 256
    key_axis: str = "auto"
    value_axis: str = "auto"
    anchor: str = "center"
    group_size: int = 64
    exact: bool = False
    anchor_bits: int = 4

    def __post_init__(self):
        def bad(msg):
            raise ConfigError(f"LynxQuantConfig: {msg}")

        if self.method not in METHODS:
            bad(f"method must be one of {METHODS}, got {self.method!r}")
        if self.anchor not in ANCHORS:
            bad(f"anchor must be one of {ANCHORS}, got {self.anchor!r}")
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                bad(f"{name} must be one of {AXES}, got {getattr(self, name)!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= float(self.alpha) <= 1e4):
            bad(f"alpha must be a number in [0, 1e4], got {self.alpha!r}")
        for name in ("chunk_size", "page_size", "group_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not (1 <= v <= 65536):
                bad(f"{name} must be an int in [1, 65536], got {v!r}")
        if self.page_size % self.chunk_size:
            bad(f"page_size ({self.page_size}) must be a multiple of chunk_size ({self.chunk_size})")
        if not isinstance(self.exact, bool):
            bad(f"exact must be True or False, got {self.exact!r}")
        if self.exact and self.method not in ("lynx", "paper"):
            bad(f"exact=True takes method 'lynx' or 'paper' (it corrects their 8-bit code), got {self.method!r}"
                + (": the identity codec is exact already" if self.method == "identity" else ""))
        if isinstance(self.anchor_bits, bool) or self.anchor_bits not in ANCHOR_BITS + (AUTO,):
            bad(f"anchor_bits must be one of {ANCHOR_BITS} or {AUTO!r}, got {self.anchor_bits!r}")
        if self.anchor_bits != 4 and self.method not in ("lynx", "paper"):
            bad(f"anchor_bits applies to method 'lynx' or 'paper' (their 8-bit code splits into an anchor and a "
                f"residual); {self.method!r} has one stream")
        if self.method == "paper" and self.anchor != "paper":
            object.__setattr__(self, "anchor", "paper")  # the published scheme has one anchor rule

    def axis(self, kind: str) -> str:
        if kind not in ("key", "value"):
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        return self.key_axis if kind == "key" else self.value_axis

    def to_dict(self) -> dict:
        """The fields (`exact` only when set, `anchor_bits` only when not 4: a default config's dict, and the digests
        over it, stay as they were)."""
        d = dataclasses.asdict(self)
        if not self.exact:
            del d["exact"]
        if self.anchor_bits == 4:
            del d["anchor_bits"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LynxQuantConfig":
        if not isinstance(d, dict):
            raise ConfigError("LynxQuantConfig.from_dict needs a dict")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"LynxQuantConfig: unknown fields {sorted(unknown)}")
        return cls(**d)

    def save_pretrained(self, save_directory, calibration: dict | None = None) -> str:
        """Write `lynx_config.json` (the fields, plus what a calibration measured) into a folder; returns its path."""
        import json
        import os

        from . import __version__

        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        body = {**self.to_dict(), "lynx_hf_version": __version__}
        if calibration is not None:
            body["calibration"] = calibration
        with open(path, "w") as f:
            json.dump(body, f, indent=2)
            f.write("\n")
        return path

    @classmethod
    def from_pretrained(cls, name_or_path, **hub_kwargs) -> "LynxQuantConfig":
        """Read `lynx_config.json` from a folder, a path to the file itself, or a Hub repo (huggingface_hub)."""
        import json
        import os

        path = os.fspath(name_or_path)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(path):
            if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") != 1:
                raise FileNotFoundError(f"no {CONFIG_NAME} at {name_or_path} (a Hub repo id looks like 'org/name')")
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(name_or_path, CONFIG_NAME, **hub_kwargs)
        try:
            with open(path) as f:
                body = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        body = {k: v for k, v in body.items() if k not in ("lynx_hf_version", "calibration")}
        return cls.from_dict(body)

    @classmethod
    def paper(cls, **kw) -> "LynxQuantConfig":
        """The scheme as published: sign-magnitude α-law code, +7-biased anchor, per-channel chunks."""
        base = dict(method="paper", alpha=255.0, anchor="paper", key_axis="channel", value_axis="channel")
        base.update(kw)
        return cls(**base)


@dataclass(frozen=True)
class SpecConfig:
    """The draft → verify loop. max_draft_steps bounds the draft steps (forward passes on the anchor tier) that
    verification may throw away (0: never draft, wait for the full tier; `max_draft_tokens` is its deprecated
    alias); draft_while_waiting=False also disables drafting. The residual is re-checked between draft steps; no
    step starts when it is due within `verify_lead` steps.
    Greedy drafts a tree (docs/drafting.md): each step runs at most `tree_width` frontier nodes and gives each the
    children its distribution needs — its tokens within `tree_cutoff` nats of its best, at most `tree_branch` —
    scored by log-softmax(scores / tree_temperature) (calibrated to predict the full tier's argmax); children more
    than `tree_cutoff` nats below the best, or whose path the full tier takes with probability below
    `verify_min_prob` (by that calibrated score), are not expanded (each row's best child always is). The verify
    pass runs the nodes at or above `verify_min_prob` and the best deepest node's path, at most `verify_nodes`:
    as many as the tree's likely paths; with `price_verify`, only the nodes whose path probability pays for their
    place in the pass, as this request's own draft steps time it (drafters.py `verify_floor`). tree_width =
    tree_branch = 1 drafts a chain; sampling always drafts a chain."""

    max_draft_steps: int = 64
    draft_while_waiting: bool = True
    tree_width: int = 8
    tree_branch: int = 4
    verify_nodes: int = 256
    verify_min_prob: float = 0.003
    tree_temperature: float = 0.1
    tree_cutoff: float = 10.0
    verify_lead: float = 3.0
    price_verify: bool = False
    max_draft_tokens: int | None = None  # deprecated alias of max_draft_steps

    @classmethod
    def for_anchor(cls, bits: int = 4, **overrides) -> "SpecConfig":
        """The defaults for an anchor of `bits` bits: a 4-bit anchor's are the class's; a 3- or 2-bit anchor is
        less often right, so its tree is scored less sharply (tree_temperature 0.3) and kept wider (16 frontier
        nodes, up to 512 verified) — measured on many-shot prompts the acceptance check does not use
        (docs/drafting.md) — and its verify pass priced (`price_verify`: a wide tree of unlikely nodes cost more
        than it kept). `overrides` win."""
        if bits not in ANCHOR_BITS:
            raise ConfigError(f"SpecConfig.for_anchor takes an anchor width of {ANCHOR_BITS}, got {bits!r} (a config's "
                              f"'auto' is resolved per request first: lynx_hf.width)")
        narrow = {} if bits == 4 else {"tree_temperature": 0.3, "tree_width": 16, "verify_nodes": 512,
                                       "price_verify": True}
        return cls(**{**narrow, **overrides})

    def __post_init__(self):
        if self.max_draft_tokens is not None:
            import warnings

            warnings.warn("SpecConfig(max_draft_tokens=...) is deprecated: it counts draft steps; use "
                          "max_draft_steps", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "max_draft_steps", self.max_draft_tokens)
            object.__setattr__(self, "max_draft_tokens", None)
        for name, lo, hi in (("max_draft_steps", 0, 4096), ("tree_width", 1, 64), ("tree_branch", 1, 64),
                             ("verify_nodes", 1, 4096)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not (lo <= v <= hi):
                raise ConfigError(f"SpecConfig: {name} must be an int in [{lo}, {hi}], got {v!r}")
        p = self.verify_min_prob
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < float(p) <= 1.0):
            raise ConfigError(f"SpecConfig: verify_min_prob must be a probability in (0, 1], got {p!r}")
        if not isinstance(self.price_verify, bool):
            raise ConfigError(f"SpecConfig: price_verify must be a bool, got {self.price_verify!r}")
        for name in ("tree_temperature", "tree_cutoff", "verify_lead"):
            t = getattr(self, name)
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not (0.0 < float(t) <= 1e4):
                raise ConfigError(f"SpecConfig: {name} must be a number in (0, 1e4], got {t!r}")
