#!/usr/bin/env python3
"""A small tree search that branches and backtracks with checkpoints and rollbacks.

The environment is a sandbox whose state lives in two places at once: a variable ``v``
in a long-running Python REPL (process memory) and the file /search/value (the
filesystem). Actions change both. Starting from v = START, the search looks for a
sequence of actions that reaches TARGET:

* at every node it takes a checkpoint, then tries each action from that checkpoint
  (rolling back between tries);
* an action whose reward (minus the distance to TARGET) is not better than the node's
  is a bad branch: rolled back at once;
* good branches get a checkpoint of their own and are explored best first, depth
  first; a branch that hits the depth limit is abandoned and the search backtracks
  (rolls back) to its parent to try the next one;
* the best branch found is kept: the sandbox ends rolled back to it, and the REPL's
  memory and the file both show its value.

Run against a running cairnd (CAIRN_URL / CAIRN_TOKEN, or the default socket):

    python3 examples/tree_search.py --target 10 --max-depth 4
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cairn import Client  # noqa: E402

ACTIONS = {"+3": "v = v + 3", "*2": "v = v * 2", "-1": "v = v - 1"}


class Env:
    """The sandbox and its REPL; every method prints what it does."""

    def __init__(self, client, args):
        self.sb = client.create(template=args.template, isolation=args.isolation, ttl=1800,
                                labels={"example": "tree_search"})
        print("created sandbox %s (%s)" % (self.sb.id, self.sb.isolation))
        self.repl = self.sb.spawn(["python3", "-i", "-u"])
        self.target = args.target
        self.seq = 0
        self.run_code("import os; os.makedirs('/search', exist_ok=True); v = %d" % args.start)
        self.checkpoints = 0
        self.rollbacks = 0

    def run_code(self, code):
        """Run code in the REPL, write v to /search/value, and return v as the REPL sees it."""
        self.seq += 1
        mark = "@%d@" % self.seq
        self.repl.send("%s; _ = open('/search/value', 'w').write(str(v)); print('%s', v)\n" % (code, mark))
        line = self.repl.read_until("\n", timeout=60)
        while mark not in line:  # skip output of earlier commands (none expected)
            line = self.repl.read_until("\n", timeout=60)
        return int(line.split(mark, 1)[1])

    def value(self):
        """v from both halves of the state; they must agree."""
        v = self.run_code("pass")
        on_disk = int(self.sb.files.read_text("/search/value"))
        assert v == on_disk, "REPL says %d, file says %d" % (v, on_disk)
        return v

    def reward(self, v):
        return -abs(self.target - v)

    def checkpoint(self, label):
        self.checkpoints += 1
        return self.sb.checkpoint(label=label)

    def rollback(self, ck):
        self.rollbacks += 1
        self.sb.rollback(ck)


def search(env, node, v, path, depth, max_depth):
    """Depth-first, best-first search below checkpoint ``node`` (state value v). Returns
    (path, checkpoint) of a branch reaching the target, or None."""
    r0 = env.reward(v)
    indent = "  " * depth
    if r0 == 0:
        return path, node
    if depth == max_depth:
        print("%sdepth limit at v=%d: dead end" % (indent, v))
        return None
    children = []
    at_node = True  # the sandbox is at the node's state
    for name, code in ACTIONS.items():
        if not at_node:
            env.rollback(node)
        nv = env.run_code(code)
        at_node = False
        r = env.reward(nv)
        if r <= r0:
            print("%stry %s: v=%d reward %d (not better than %d): bad branch, rollback" % (indent, name, nv, r, r0))
            continue
        ck = env.checkpoint("%s%s" % ("".join(path), name))
        print("%stry %s: v=%d reward %d: keep (checkpoint %s)" % (indent, name, nv, r, ck.id))
        children.append((r, name, nv, ck))
    for r, name, nv, ck in sorted(children, key=lambda c: -c[0]):
        print("%sexplore %s (v=%d)" % (indent, " ".join(path + [name]), nv))
        env.rollback(ck)
        found = search(env, ck, nv, path + [name], depth + 1, max_depth)
        if found:
            return found
        print("%sbacktrack to v=%d" % (indent, v))
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, default=1)
    ap.add_argument("--target", type=int, default=10)
    ap.add_argument("--max-depth", type=int, default=4)
    ap.add_argument("--template", default="debian")
    ap.add_argument("--isolation", default=os.environ.get("CAIRN_ISOLATION") or None)
    args = ap.parse_args()

    c = Client()
    t0 = time.monotonic()
    env = Env(c, args)
    try:
        root = env.checkpoint("root")
        print("searching %d -> %d with actions %s, depth <= %d (root checkpoint %s)"
              % (args.start, args.target, " ".join(ACTIONS), args.max_depth, root.id))
        found = search(env, root, args.start, [], 0, args.max_depth)
        if found is None:
            env.rollback(root)
            print("no path within depth %d; sandbox rolled back to the root" % args.max_depth)
        else:
            path, ck = found
            env.rollback(ck)  # keep the best branch
            v = env.value()
            print("found: %d %s = %d; sandbox kept at checkpoint %s, REPL and file agree: v=%d"
                  % (args.start, " ".join(path), args.target, ck.id, v))
        tree = c.tree(env.sb.id)
        print("lineage (%d checkpoints, %d rollbacks, %.1f s):" % (len(tree), env.rollbacks, time.monotonic() - t0))
        print(tree)
        print("RESULT %s" % ("found " + " ".join(found[0]) if found else "none"))
    finally:
        env.sb.destroy()
        print("destroyed sandbox %s" % env.sb.id)


if __name__ == "__main__":
    main()
