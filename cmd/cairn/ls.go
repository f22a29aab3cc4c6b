package main

import (
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
)

func newLsCmd(a *app) *cobra.Command {
	var (
		labels       []string
		quiet        bool
		session, run string
	)
	cmd := &cobra.Command{
		Use:     "ls [flags]",
		Aliases: []string{"list"},
		Short:   "List sandboxes",
		Long: `Ls lists sandboxes: ID, template, isolation backend, state (running or stopped),
head checkpoint, age and labels. --label k=v keeps only the sandboxes carrying that
label (repeat it to require several); -q prints the IDs only.`,
		Example: `  cairn ls
  cairn ls --label owner=alice -q
  cairn ls --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			want, err := parseLabels(labels)
			if err != nil {
				return err
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			sbs, err := e.List(cmd.Context(), client.ListOptions{Labels: want, Session: session, Run: run})
			if err != nil {
				return err
			}
			if sbs == nil {
				sbs = []*client.Sandbox{}
			}
			return emit(a, cmd, sbs, func(w io.Writer) error { return sandboxTable(w, sbs, quiet) })
		},
	}
	cmd.Flags().StringArrayVarP(&labels, "label", "l", nil, "only sandboxes with label key=value (repeatable)")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print sandbox IDs only")
	cmd.Flags().StringVar(&session, "session", "", "only sandboxes of this session (cairnd only)")
	cmd.Flags().StringVar(&run, "run", "", "only sandboxes of this run (cairnd only)")
	return cmd
}

func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

func sandboxTable(w io.Writer, sbs []*client.Sandbox, quiet bool) error {
	if quiet {
		t := newTable(w)
		for _, sb := range sbs {
			t.row(sb.ID)
		}
		return t.flush()
	}
	t := newTable(w, "ID", "TEMPLATE", "ISOLATION", "STATE", "HEAD", "CREATED", "LABELS")
	for _, sb := range sbs {
		t.row(sb.ID, orDash(sb.Template), sb.Isolation, sb.State, orDash(sb.Head), humanTime(sb.CreatedAt), orDash(labelString(sb.Labels)))
	}
	return t.flush()
}
