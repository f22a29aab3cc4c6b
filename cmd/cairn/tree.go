package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine/model"
)

func newTreeCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "tree SANDBOX",
		Short: "Show the checkpoint lineage of a sandbox",
		Long: `Tree shows the checkpoints of a sandbox's lineage — its own checkpoints and, for a
fork, the checkpoints it descends from — as a tree from parents to children, with
each checkpoint's ID, label, age and process image size. The sandbox's head (the
checkpoint its current state descends from) is marked with "*"; checkpoints taken in
another sandbox name it.

With --json: {"sandbox": ID, "head": CHECKPOINT, "checkpoints": [records, oldest
first]}; each record names its parent.`,
		Example: `  cairn tree $id
  cairn tree --json $id | jq -r '.checkpoints[].id'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			tr, err := e.Tree(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if tr.Checkpoints == nil {
				tr.Checkpoints = []*model.Checkpoint{}
			}
			return emit(a, cmd, tr, func(w io.Writer) error { return drawTree(w, tr) })
		},
	}
}

// drawTree prints the checkpoints as an ASCII tree, parents before children.
func drawTree(w io.Writer, tr *client.Tree) error {
	cks := tr.Checkpoints
	sb := struct{ ID, Head string }{tr.Sandbox, tr.Head}
	if len(cks) == 0 {
		_, err := fmt.Fprintf(w, "sandbox %s has no checkpoints yet (take one with `cairn checkpoint %s`)\n", sb.ID, sb.ID)
		return err
	}
	known := map[string]bool{}
	for _, c := range cks {
		known[c.ID] = true
	}
	children := map[string][]*model.Checkpoint{}
	var roots []*model.Checkpoint
	for _, c := range cks {
		if c.Parent == "" || !known[c.Parent] {
			roots = append(roots, c)
		} else {
			children[c.Parent] = append(children[c.Parent], c)
		}
	}
	fmt.Fprintf(w, "sandbox %s (head %s)\n", sb.ID, orDash(sb.Head))
	t := newTable(w)
	var walk func(c *model.Checkpoint, prefix string, last bool)
	walk = func(c *model.Checkpoint, prefix string, last bool) {
		branch, indent := "|-- ", "|   "
		if last {
			branch, indent = "`-- ", "    "
		}
		mark, note := "", ""
		if c.ID == sb.Head {
			mark = " *"
		}
		if c.SandboxID != sb.ID {
			note = "sandbox " + c.SandboxID
		}
		t.row(prefix+branch+c.ID+mark, orDash(c.Label), humanTime(c.CreatedAt), humanSize(c.ImageBytes), note)
		kids := children[c.ID]
		for i, k := range kids {
			walk(k, prefix+indent, i == len(kids)-1)
		}
	}
	for i, r := range roots {
		walk(r, "", i == len(roots)-1)
	}
	return t.flush()
}
