package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/engine/model"
)

func newDiffCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "diff CHECKPOINT1 CHECKPOINT2",
		Short: "List the files that differ between two checkpoints",
		Long: `Diff compares the filesystems of two checkpoints and prints one line per path that
differs, sorted by path:

  A path   added in CHECKPOINT2
  M path   modified (content, size, type, mode, owner or link target)
  D path   deleted in CHECKPOINT2

cairn's control directory /.cairn is left out. With --json: a list of
{"kind": "added"|"changed"|"deleted", "path": ...}.`,
		Example: `  cairn diff $c1 $c2
  cairn diff $c1 $c2 | grep '^A '`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			changes, err := e.Diff(cmd.Context(), args[0], args[1])
			if err != nil {
				return err
			}
			if changes == nil {
				changes = []model.Change{}
			}
			return emit(a, cmd, changes, func(w io.Writer) error {
				for _, c := range changes {
					fmt.Fprintf(w, "%s %s\n", changeLetter(c.Kind), c.Path)
				}
				return nil
			})
		},
	}
}

func changeLetter(kind string) string {
	switch kind {
	case "added":
		return "A"
	case "deleted":
		return "D"
	}
	return "M"
}
