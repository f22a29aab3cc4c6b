package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/engine/model"
)

// ckpt manages existing checkpoints; `cairn checkpoint SANDBOX` takes new ones.
func newCkptCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "ckpt COMMAND",
		Aliases: []string{"checkpoints"},
		Short:   "Manage existing checkpoints (ls, inspect, rm)",
		Long: `Ckpt manages existing checkpoints (` + "`cairn checkpoint SANDBOX`" + ` takes a new one):

  cairn ckpt ls SANDBOX                   list a sandbox's lineage, oldest first
  cairn ckpt inspect CHECKPOINT           show one checkpoint
  cairn ckpt rm [--cascade] CHECKPOINT... delete checkpoints

See also ` + "`cairn tree`" + ` (the lineage drawn as a tree) and ` + "`cairn gc`" + `.`,
		Example: `  cairn ckpt ls $id
  cairn ckpt rm $c2
  cairn ckpt rm --cascade $c1`,
		Args: cobra.NoArgs,
		RunE: showHelp,
	}
	cmd.AddCommand(newCkptLsCmd(a), newCkptInspectCmd(a), newCkptRmCmd(a))
	return cmd
}

func newCkptLsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "ls SANDBOX",
		Short: "List the checkpoints of a sandbox's lineage",
		Long: `Ls lists the checkpoints of a sandbox's lineage (its own and those it was forked
from), oldest first, with their parents; the head is marked with "*".`,
		Example: "  cairn ckpt ls $id\n  cairn ckpt ls --json $id",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			tr, err := e.Tree(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			cks := tr.Checkpoints
			if cks == nil {
				cks = []*model.Checkpoint{}
			}
			return emit(a, cmd, cks, func(w io.Writer) error {
				t := newTable(w, "ID", "PARENT", "SANDBOX", "LABEL", "CREATED", "IMAGES", "HEAD")
				for _, c := range cks {
					head := ""
					if c.ID == tr.Head {
						head = "*"
					}
					t.row(c.ID, orDash(c.Parent), c.SandboxID, orDash(c.Label), humanTime(c.CreatedAt), humanSize(c.ImageBytes), head)
				}
				return t.flush()
			})
		},
	}
}

func newCkptInspectCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "inspect CHECKPOINT",
		Short:   "Show the details of a checkpoint",
		Long:    "Inspect shows everything cairn records about a checkpoint (the record itself with --json).",
		Example: "  cairn ckpt inspect $c1",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			ck, err := e.GetCheckpoint(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return emit(a, cmd, ck, func(w io.Writer) error { return describeCheckpoint(w, ck) })
		},
	}
}

func newCkptRmCmd(a *app) *cobra.Command {
	var cascade bool
	cmd := &cobra.Command{
		Use:   "rm [flags] CHECKPOINT...",
		Short: "Delete checkpoints",
		Long: `Rm deletes checkpoints and prints the IDs deleted. A checkpoint with children
(later checkpoints branching from it) is refused unless --cascade, which deletes its
whole subtree. Sandboxes and other checkpoints never break: each checkpoint is an
independent copy. A sandbox whose head is deleted keeps running but can no longer be
resumed from it.`,
		Example: "  cairn ckpt rm $c2\n  cairn ckpt rm --cascade $c1",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			removed := []string{}
			for _, id := range args {
				victims, err := e.DeleteCheckpoint(cmd.Context(), id, cascade)
				if err != nil {
					for _, v := range removed {
						fmt.Fprintln(cmd.ErrOrStderr(), "removed", v)
					}
					return err
				}
				removed = append(removed, victims...)
			}
			return emit(a, cmd, map[string]any{"removed": removed}, func(w io.Writer) error {
				for _, v := range removed {
					fmt.Fprintln(w, v)
				}
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&cascade, "cascade", false, "also delete the checkpoint's descendants")
	return cmd
}
