"""Token-tree math (lynx_hf.tree) on random distributions, against brute force: growth, the verified subtree, the
re-indexing, the ancestor mask and the child lookup. Exact (integer bookkeeping; scores are sums of log-probs)."""
import math
import pytest
import torch

from lynx_hf.spec import UNUSED
from lynx_hf.tree import NO_NODE, ROOT, Tree, best_subtree, child_with_token, restrict, walk_tree

B, V = 3, 11


def grow(steps, branch, width, stop=None, cutoff=float("inf"), seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = Tree.empty(B, "cpu")
    m = 1
    for _ in range(steps):
        logp = torch.log_softmax(torch.randn(B, m, V, generator=g) * 3, -1)
        tree.add_children(logp, branch, width, stop, cutoff)
        m = tree.frontier.shape[1]
    return tree


def path_of(tree, b, i):
    out = []
    while i != ROOT:
        out.append(i)
        i = int(tree.parent[b, i])
    return out[::-1]


@pytest.mark.parametrize("branch,width", [(1, 1), (2, 3), (4, 4), (3, 8)])
def test_growth_invariants(branch, width):
    tree = grow(6, branch, width)
    for b in range(B):
        for i in range(tree.size):
            p = int(tree.parent[b, i])
            if p == ROOT:
                assert tree.depth[b, i] == 1
            else:
                assert p < i and tree.depth[b, i] == tree.depth[b, p] + 1
                assert tree.score[b, i] <= tree.score[b, p]  # a child never outscores its parent
        # siblings are distinct tokens
        pairs = {(int(tree.parent[b, i]), int(tree.tokens[b, i])) for i in range(tree.size)}
        assert len(pairs) == tree.size
    assert tree.frontier.shape[1] <= width
    assert int(tree.depth.max()) == 6
    assert (tree.depth.gather(1, tree.frontier) == 6).all()
    if branch == width == 1:  # a chain: the greedy line
        assert tree.size == 6


def test_frontier_is_the_best_children_and_skips_stop_tokens():
    g = torch.Generator().manual_seed(3)
    tree = Tree.empty(B, "cpu")
    tree.add_children(torch.log_softmax(torch.randn(B, 1, V, generator=g), -1), 4, 2)
    logp = torch.log_softmax(torch.randn(B, 2, V, generator=g), -1)
    stop = logp[0, 0].argmax().reshape(1)  # the best child of row 0's best node is a stop token
    first = tree.size
    tree.add_children(logp, 4, 3, stop)
    new = torch.arange(first, tree.size)
    for b in range(B):
        ok = [int(i) for i in new if int(tree.tokens[b, i]) not in stop.tolist()]
        want = sorted(ok, key=lambda i: -float(tree.score[b, i]))[:3]
        assert sorted(tree.frontier[b].tolist()) == sorted(want)


def test_cutoff_narrows_the_frontier_and_a_certain_stop_ends_it():
    g = torch.Generator().manual_seed(5)
    tree = Tree.empty(B, "cpu")
    tree.add_children(torch.log_softmax(torch.randn(B, 1, V, generator=g), -1), 4, 4, cutoff=0.0)
    assert tree.frontier.shape[1] == 1  # only the best child is within 0 nats of the best
    logp = torch.full((B, 1, V), -50.0)
    logp[:, :, 7] = 0.0  # token 7 is certain, and it stops
    tree.add_children(logp, 4, 4, torch.tensor([7]), cutoff=10.0)
    assert tree.frontier.shape[1] == 0


def test_best_subtree_is_ancestor_closed_sorted_and_holds_the_best_path():
    tree = grow(7, 3, 4)
    for n in (1, 5, 17, 1000):
        nodes = best_subtree(tree, n, cutoff=3.0)
        for b in range(B):
            s = set(nodes[b].tolist())
            assert len(s) == nodes.shape[1]
            for i in s:
                assert set(path_of(tree, b, i)) <= s  # ancestor-closed
            d = tree.depth[b, nodes[b]]
            assert (d[1:] >= d[:-1]).all()  # parents first
            best = int(tree.frontier[b, 0])  # the best deepest node
            if n >= int((tree.score[b] >= tree.score[b, best]).sum()):  # budget permitting, its path is in
                assert set(path_of(tree, b, best)) <= s


def test_restrict_and_path_nodes_match_brute_force():
    tree = grow(5, 3, 3)
    nodes = best_subtree(tree, 12)
    tok, par, dep = restrict(tree, nodes)
    sub = Tree(tok, par, dep, tree.score.gather(1, nodes))
    anc = sub.path_nodes(torch.arange(nodes.shape[1]).expand_as(nodes))
    for b in range(B):
        for j in range(nodes.shape[1]):
            i = int(nodes[b, j])
            assert tok[b, j] == tree.tokens[b, i] and dep[b, j] == tree.depth[b, i]
            want = [nodes[b].tolist().index(a) for a in path_of(tree, b, i)][::-1]  # the node itself first
            got = anc[b, j].tolist()
            assert got[:len(want)] == want and set(got[len(want):]) <= {NO_NODE}


def test_restrict_refuses_a_set_that_is_not_a_subtree():
    tree = grow(3, 2, 2)
    deep = (tree.depth == 3).long().argmax(1, keepdim=True)
    with pytest.raises(ValueError, match="subtree"):
        restrict(tree, deep)


def test_child_with_token():
    parent = torch.tensor([[ROOT, ROOT, 0, 0, 2], [ROOT, 0, 1, 1, ROOT]])
    tokens = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    assert child_with_token(parent, tokens, torch.tensor([ROOT, ROOT]), torch.tensor([6, 9])).tolist() == [1, 4]
    assert child_with_token(parent, tokens, torch.tensor([0, 1]), torch.tensor([8, 7])).tolist() == [3, 2]
    assert child_with_token(parent, tokens, torch.tensor([4, 1]), torch.tensor([9, 6])).tolist() == [-1, -1]


def test_paths():
    tree = grow(4, 2, 2)
    paths = tree.paths(tree.frontier)
    for b in range(B):
        for j, i in enumerate(tree.frontier[b].tolist()):
            assert paths[b, j].tolist() == [int(tree.tokens[b, a]) for a in path_of(tree, b, i)]


def test_an_empty_tree_verifies_the_root_alone():
    tree = Tree.empty(B, "cpu")  # the residual landed before the first draft step
    nodes = best_subtree(tree, 8)
    assert nodes.shape == (B, 0)
    tok, par, dep = restrict(tree, nodes)
    assert tok.shape == par.shape == dep.shape == (B, 0)


@pytest.mark.parametrize("seed", range(6))
def test_walk_tree_is_the_longest_path_the_target_agrees_with(seed):
    """walk_tree against brute force over every root-to-node path: accepted = the longest path whose every node
    carries the target's choice after its parent; tokens = that path's tokens, then the choice after its last node;
    every row emits accepted + 1 tokens (rows independent). Targets copy tree tokens often, so paths run deep."""
    tree = grow(5, 3, 4, seed=seed)
    nodes = best_subtree(tree, 40)
    tok, par, dep = restrict(tree, nodes)
    g = torch.Generator().manual_seed(100 + seed)
    n = tok.shape[1]
    choice = torch.randint(0, V, (B, n + 1), generator=g)
    for b in range(B):  # make the target agree with some child of most nodes
        for j in range(-1, n):
            kids = [i for i in range(n) if int(par[b, i]) == j]
            if kids and torch.rand(1, generator=g) < 0.8:
                choice[b, j + 1] = tok[b, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    accepted, path, out = walk_tree(par, tok, choice)
    for b in range(B):
        def agrees(i):  # node i carries the target's choice after its parent, and so does every ancestor
            p = int(par[b, i])
            return int(tok[b, i]) == int(choice[b, p + 1]) and (p == ROOT or agrees(p))
        best = max([[]] + [[k for k in range(n) if k in anc] for i in range(n) if agrees(i)
                           for anc in [set(_ancestry(par[b], i))]], key=len)
        best = sorted(best, key=lambda i: int(dep[b, i]))
        assert int(accepted[b]) == len(best)
        assert path[b, :len(best)].tolist() == best and (path[b, len(best):] == -1).all()
        last = best[-1] if best else ROOT
        assert out[b, :len(best)].tolist() == [int(tok[b, i]) for i in best]
        assert int(out[b, len(best)]) == int(choice[b, last + 1])
        assert (out[b, len(best) + 1:] == UNUSED).all()
    assert int(accepted.max()) >= 2  # the walk went deep somewhere (the case is not trivial)


def _ancestry(parent_row, i):
    out = []
    while i != ROOT:
        out.append(i)
        i = int(parent_row[i])
    return out


def test_children_by_confidence():
    """A sure node gets one child, a near-tie as many as lie within the cutoff (at most `branch`); unneeded slots
    score −inf and never reach the frontier."""
    from lynx_hf.tree import Tree

    logp = torch.full((1, 1, 10), -50.0)
    logp[0, 0, 3] = 0.0
    t = Tree.empty(1, "cpu")
    t.add_children(logp, branch=4, width=8, cutoff=5.0)
    assert t.tokens.tolist() == [[3]] and t.frontier.tolist() == [[0]]
    logp = torch.full((1, 1, 10), -50.0)
    logp[0, 0, [5, 6, 7]] = torch.tensor([0.0, -1.0, -4.0])               # near-ties: three children within the cutoff
    t.add_children(logp, branch=4, width=8, cutoff=5.0)
    assert t.tokens[0, 1:].tolist() == [5, 6, 7] and t.frontier.tolist() == [[1, 2, 3]]
    two = torch.full((1, 3, 10), -50.0)
    two[0, :, 1] = 0.0
    two[0, 0, 2] = -0.5                                                     # only node 1 has a runner-up
    t.add_children(two, branch=4, width=8, cutoff=5.0)
    new = t.score[0, 4:]
    assert new.shape[0] == 6 and torch.isinf(new).sum() == 2               # 2 slots each, one unneeded per sure node
    assert t.frontier.shape[1] == 4 and bool(torch.isfinite(t.score.gather(1, t.frontier)).all())


def test_floor_keeps_unlikely_children_out_of_the_frontier_and_the_verify_pass():
    """A child whose calibrated score is below the floor is never expanded (but each row's best is: the main line
    goes on) and never verified (but the best deepest node's path is, whatever its score)."""
    logp = torch.full((1, 1, 10), -50.0)
    logp[0, 0, [2, 3, 4]] = torch.log(torch.tensor([0.6, 0.3, 0.001]))
    t = Tree.empty(1, "cpu")
    t.add_children(logp, branch=4, width=8, cutoff=10.0, floor=math.log(0.01))
    assert t.frontier.tolist() == [[0, 1]]                                  # token 4 (p = 0.001) stays a leaf
    low = torch.full((1, 2, 10), -50.0)
    low[0, :, 5] = math.log(0.004)                                          # every child below the floor
    t.add_children(low, branch=4, width=8, cutoff=10.0, floor=math.log(0.01))
    assert t.frontier.shape[1] == 1 and int(t.tokens[0, t.frontier[0, 0]]) == 5   # the best child goes on alone
    deepest = int(t.frontier[0, 0])
    nodes = best_subtree(t, 100, floor=math.log(0.01))[0].tolist()
    assert set(path_of(t, 0, deepest)) <= set(nodes)                       # the best path, below the floor
    assert 2 not in nodes                                                  # token 4's leaf: below, off the path
    assert len(nodes) == len(best_subtree(t, 100, floor=math.log(0.01))[0])
    assert best_subtree(t, 100)[0].shape[0] > len(nodes)                   # no floor: every node is verified


def test_a_node_is_verified_only_where_its_path_probability_pays_for_it():
    from types import SimpleNamespace

    from lynx_hf.engine.drafters import TreeDrafter

    floor = math.log(0.003)  # verify_min_prob's
    d = SimpleNamespace(floor=floor, costs=[(1, 0.084), (8, 0.112), (16, 0.144), (8, 0.112)],  # T(m) = 0.08 + 0.004 m
                        spec=SimpleNamespace(price_verify=True))
    assert TreeDrafter.verify_floor(d) == pytest.approx(math.log(0.004 / 0.084))  # a node pays iff p > c / (a + c)
    d.spec.price_verify = False  # (a 4-bit anchor's default: verify_min_prob alone)
    assert TreeDrafter.verify_floor(d) == floor
    d.spec.price_verify = True
    d.costs = [(1, 0.084), (1, 0.09)]  # one frontier size: a and c not apart
    assert TreeDrafter.verify_floor(d) == floor
    d.costs = [(1, 0.09), (8, 0.08)]  # noise: wider steps faster
    assert TreeDrafter.verify_floor(d) == floor
    d.costs = [(1, 0.1), (16, 0.1 + 15 * 1e-5)]  # nodes nearly free: never below verify_min_prob's floor
    assert TreeDrafter.verify_floor(d) == floor
