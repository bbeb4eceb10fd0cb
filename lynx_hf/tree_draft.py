"""Greedy tree drafting on the anchor tier and its one-pass verification on the full tier, for speculative_generate.

Drafting (`draft_tree`): step 1 runs the root (the last verified token) as usual; every later step runs the tree's
frontier — `SpecConfig.tree_width` nodes of one depth per row — in one forward pass, with per-node positions and a
tree attention mask (each node sees the prompt, the verified tokens and its own ancestors). The nodes' KV stays in the
cache's tail until verification. A draft step is one forward pass; the loop stops when the residual is in, when the
policy says the residual is due before another step would end (`DraftPolicy`), at `max_draft_tokens` steps or at
the length limit.

Verification (`verify_tree`): the anchor-phase tail is dropped, the prompt switches to the full tier layer by layer
(each layer at its turn in the pass, once its residual is in), and one forward pass runs [verified tokens since the
prompt, the `verify_nodes` best tree nodes]. The walk from the root emits, at each depth, the full tier's choice
through the caller's logits processors (exactly what plain greedy `generate` would emit) and follows the child
carrying it; it stops at the first depth where some live row has no such child (that token is the correction) or
after the deepest accepted node (the bonus token). Only the accepted path's KV is kept: it is gathered in place (no
recomputation). Sampling uses the chain (generate.py), whose rejection rule is lossless; greedy gets the tree."""
from __future__ import annotations

import time

import torch

from .policy import DraftPolicy
from .tree import ROOT, Tree, best_subtree, child_with_token, restrict

TREE_ATTENTION = ("sdpa", "eager")  # implementations that take a custom 4D mask as is


def _attn_impl(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def use_tree(run) -> bool:
    spec = run.cache.spec_config
    branching = spec.tree_width > 1 or spec.tree_branch > 1
    return not run.do_sample and branching and _attn_impl(run.model) in TREE_ATTENTION


def _stop_tokens(run) -> torch.Tensor:
    """Token ids that end a row (EOS criteria): such nodes are never expanded."""
    ids = [c.eos_token_id for c in run.sc if hasattr(c, "eos_token_id")]
    ids = [t.reshape(-1) for t in ids if isinstance(t, torch.Tensor)]
    return torch.cat(ids).to(run.ids.device) if ids else run.ids.new_zeros(0)


def _attention_mask(run, vis: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor):
    """vis [B, q, K] (who may see whom, over the full key length) → what the model's forward takes: one 4D mask, or
    one per layer type (models mixing full and sliding layers). Sliding layers hold keys from their offset on and see
    only the last W logical positions."""
    impl = _attn_impl(run.model)
    masks = {}
    for layer in run.cache.layers:
        kind = "sliding_attention" if layer.is_sliding else "full_attention"
        if kind in masks:
            continue
        m = vis[:, :, layer.offset:]
        if layer.is_sliding:
            m = m & ((q_idx[:, :, None] - k_idx[:, None, layer.offset:]) < layer.sliding_window)
        m = m[:, None]                                                           # [B, 1, q, K_layer]
        if impl != "sdpa":  # additive float mask
            dt = run.cache.dtype
            m = torch.zeros(m.shape, dtype=dt, device=m.device).masked_fill(~m, torch.finfo(dt).min)
        masks[kind] = m
    return masks if len(masks) > 1 else next(iter(masks.values()))


def tree_forward(run, tree: Tree, nodes: torch.Tensor, slots: torch.Tensor, n_seq: int, n_logits: int):
    """Run [the last n_seq verified tokens, tree nodes `nodes` [B, n]] after the cache, whose tail ends with the tree
    nodes `slots` [B, Ns] run before (n_seq = 0 unless Ns = 0). Float32 logits [B, n_logits, V] of the last
    n_logits positions."""
    cache, ids = run.cache, run.ids
    (B, L), dev = ids.shape, ids.device
    n, Ns = nodes.shape[1], slots.shape[1]
    C0 = cache.get_seq_length() - Ns  # keys before the tree's slots: prompt and verified tokens
    if C0 != L - n_seq:
        raise RuntimeError(f"cache holds {C0} sequence positions, expected {L - n_seq}")
    dq, ds = tree.depth.gather(1, nodes), tree.depth.gather(1, slots)
    q_idx = torch.cat([torch.arange(C0, L, device=dev).expand(B, n_seq), L - 1 + dq], 1)  # logical positions [B, q]
    k_idx = torch.cat([torch.arange(C0, device=dev).expand(B, C0), L - 1 + ds, q_idx], 1)  # [B, K]
    q, K = n_seq + n, C0 + Ns + n_seq + n
    anc = tree.path_nodes(nodes)                                                 # [B, n, d]
    sees = (torch.cat([slots, nodes], 1)[:, None, :, None] == anc[:, :, None, :]).any(-1)  # [B, n, Ns + n]
    vis = torch.zeros(B, q, K, dtype=torch.bool, device=dev)
    vis[:, :, :C0] = True
    s0 = C0 + Ns  # first new column
    vis[:, :n_seq, s0:s0 + n_seq] = torch.ones(n_seq, n_seq, dtype=torch.bool, device=dev).tril()
    vis[:, n_seq:, s0:s0 + n_seq] = True
    vis[:, n_seq:, C0:s0] = sees[:, :, :Ns]
    vis[:, n_seq:, s0 + n_seq:] = sees[:, :, Ns:]
    pad = run.pad_mask(L)                                                        # [B, L] bool or None
    if pad is not None:
        vis[:, :, :C0] &= pad[:, None, :C0]
        vis[:, :, s0:s0 + n_seq] &= pad[:, None, C0:L]
        seq_pos = (pad.long().cumsum(-1) - 1).clamp_min(0)[:, C0:L]
        root_pos = pad.long().sum(-1) - 1
    else:
        seq_pos, root_pos = torch.arange(C0, L, device=dev).expand(B, n_seq), torch.full((B,), L - 1, device=dev)
    pos = torch.cat([seq_pos, root_pos[:, None] + dq], 1)
    new_ids = torch.cat([ids[:, L - n_seq:], tree.tokens.gather(1, nodes)], 1)
    kw = dict(input_ids=new_ids, cache=cache, use_cache=True, position_ids=pos,
              attention_mask=_attention_mask(run, vis, q_idx, k_idx))
    return run.model(logits_to_keep=n_logits, **kw).logits[:, -n_logits:].float()


def draft_tree(run):
    """Grow the draft tree on the anchor tier. Returns (tree, main): main lists, per depth, the node [B] whose token
    went to a provisional streamer (the anchor tier's own greedy line, while it is being expanded)."""
    cache, spec = run.cache, run.cache.spec_config
    B, L = run.ids.shape
    stop = _stop_tokens(run)
    max_len = getattr(run.sc, "max_length", None)
    budget = spec.max_draft_tokens if max_len is None else min(spec.max_draft_tokens, max_len - L)
    tree, slots, main = Tree.empty(B, run.ids.device), run.ids.new_zeros(B, 0), []
    policy = DraftPolicy(cache)
    while len(main) < budget and (tree.size == 0 or tree.frontier.shape[1]) and policy.another_step():
        t = time.perf_counter()
        if tree.size == 0:
            nodes, logits = None, run.forward(run.ids[:, -1:], 1)                  # the root: [B, 1, V]
            ctx = [run.ids]
        else:
            nodes = tree.frontier                                                   # [B, m]
            logits = tree_forward(run, tree, nodes, slots, 0, nodes.shape[1])      # [B, m, V]
            slots = torch.cat([slots, nodes], 1)
            paths = tree.paths(nodes)                                               # [B, m, d]
            ctx = [torch.cat([run.ids, paths[:, j]], 1) for j in range(nodes.shape[1])]
        scores = torch.stack([run.process(c, logits[:, j]) for j, c in enumerate(ctx)], 1)
        first = tree.size
        tree.add_children(torch.log_softmax(scores / spec.tree_temperature, -1), spec.tree_branch, spec.tree_width,
                          stop, spec.tree_cutoff)
        _extend_main(run, tree, main, nodes, first)
        cache.timeline.append((time.perf_counter(), "draft"))
        if cache.stats["ttft_draft_s"] is None:
            cache.stats["ttft_draft_s"] = time.perf_counter() - run.t0
        cache.stats["drafted"] += 1
        policy.stepped(time.perf_counter() - t)
        cache.notify_drafted(len(main))
    return tree, main


def _extend_main(run, tree: Tree, main: list, nodes, first: int) -> None:
    """Append the top child of the last main-line node when that node was just expanded (always after the root)."""
    B = tree.tokens.shape[0]
    if nodes is None:
        child = torch.full((B,), first, device=tree.tokens.device)  # topk is sorted: the root's best child
    else:
        hit = nodes == main[-1][:, None] if main and main[-1] is not None else None   # [B, m]
        if hit is None or not bool(hit.any(1).all()):
            main.append(None)
            return
        k = (tree.size - first) // nodes.shape[1]  # children per expanded node
        child = first + hit.long().argmax(1) * k
    main.append(child)
    if run.provisional:
        run.streamer.put_provisional(run.pad_finished(tree.tokens.gather(1, child[:, None])[:, 0]).cpu())
        run.pending_drafts += 1


def verify_tree(run, tree: Tree, main: list) -> bool:
    """Verify the tree in one full-tier pass and emit the accepted path plus one token. True when generation is over."""
    cache, spec, P = run.cache, run.cache.spec_config, run.cache.prompt_len
    t = time.perf_counter()
    cache.timeline.append((t, "verify_start"))
    cache.crop(P - cache.get_seq_length())  # the draft-phase tail was computed against the anchor tier
    cache.set_full_tier_per_layer()  # the pass below runs each layer once its residual is in
    B, L = run.ids.shape
    nodes = best_subtree(tree, spec.verify_nodes, spec.tree_cutoff)                 # [B, n], tree numbering
    tok, par, dep = restrict(tree, nodes)                                           # subtree numbering 0..n-1
    sub = Tree(tok, par, dep, tree.score.gather(1, nodes))
    n, n_seq = nodes.shape[1], L - P
    idx = torch.arange(n, device=tok.device).expand(B, n)
    logits = tree_forward(run, sub, idx, idx[:, :0], n_seq, n + 1)                 # [B, n + 1, V]: root, nodes
    cache.stats["verify_s"] += time.perf_counter() - t
    cache.stats["rounds"] += 1
    cache.stats["tree_nodes"] += n
    cur, path, done = torch.full((B,), ROOT, device=tok.device), [], False
    while True:
        lg = logits[torch.arange(B, device=tok.device), cur + 1]                   # [B, V]
        scores = run.process(run.ids, lg)
        live = run.live().clone()  # rows whose token here is real (one finishing at it still counts)
        done = run.emit(scores.argmax(-1), scores, lg)
        child = child_with_token(par, tok, cur, run.ids[:, -1])
        matched = not bool(((child < 0) & live).any())
        if matched:
            cur = child.clamp_min(0)  # rows that no longer matter follow any node
            path.append(cur)
        if done or not matched:
            break
    cache.stats["accepted"] += len(path)
    kept = 0
    for m, p in zip(main, path):  # provisional drafts that stood: the main line's agreement with the path
        if m is None or not bool((nodes.gather(1, p[:, None])[:, 0] == m).all()):
            break
        kept += 1
    run.resolve(kept)
    run.flush()
    keep = run.ids.shape[1] - 1 - L  # verified tokens the cache must hold beyond the sequence part
    cache.keep_tail(L, torch.stack(path[:keep], 1) if keep else cur.new_zeros(B, 0))
    return done
