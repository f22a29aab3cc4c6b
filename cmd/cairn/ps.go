package main

import (
	"fmt"
	"io"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/engine/model"
)

func newPsCmd(a *app) *cobra.Command {
	var prune bool
	cmd := &cobra.Command{
		Use:   "ps [flags] SANDBOX",
		Short: "List the processes started in a sandbox",
		Long: `Ps lists the processes started in a sandbox with ` + "`cairn exec`" + `, oldest first:
handle, pid (inside the sandbox), status (running, exited N, or killed by a signal),
age and command line. After a rollback it shows the processes as of the checkpoint.

A process's record (its output and exit status) stays after it exits: those of
foreground execs are removed when the exec returns (unless ` + "`exec --keep`" + `), those of
` + "`exec -d`" + ` until --prune removes the records of every exited process (and lists
them). Records are files of the sandbox's root: checkpoints hold them, rollbacks
bring them back.`,
		Example: "  cairn ps $id\n  cairn ps --json $id\n  cairn ps --prune $id",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			e, err := a.backend(ctx)
			if err != nil {
				return err
			}
			ps, err := e.Processes(ctx, args[0])
			if err != nil {
				return err
			}
			if prune {
				var gone []*model.Process
				for _, p := range ps {
					if p.Exit == nil {
						continue
					}
					if err := e.RemoveProcess(ctx, args[0], p.Handle); err != nil {
						return err
					}
					gone = append(gone, p)
				}
				ps = gone
			}
			if ps == nil {
				ps = []*model.Process{}
			}
			return emit(a, cmd, ps, func(w io.Writer) error {
				t := newTable(w, "HANDLE", "PID", "STATUS", "STARTED", "COMMAND")
				for _, p := range ps {
					t.row(p.Handle, p.Pid, procStatus(p), humanTime(p.StartedAt), quoteArgs(p.Args))
				}
				return t.flush()
			})
		},
	}
	cmd.Flags().BoolVar(&prune, "prune", false, "remove the records of the exited processes, and list those")
	return cmd
}

// procStatus renders a process's state: "running", "exited 0", "killed (SIGKILL)".
func procStatus(p *model.Process) string {
	switch {
	case p.Exit != nil && p.Exit.Signal != 0:
		return fmt.Sprintf("killed (%s)", orDash(unix.SignalName(syscall.Signal(p.Exit.Signal))))
	case p.Exit != nil:
		return fmt.Sprintf("exited %d", p.Exit.Code)
	case p.Running:
		return "running"
	}
	return "stopped"
}

// quoteArgs renders a command line, single-quoting arguments that need it.
func quoteArgs(args []string) string {
	out := make([]string, len(args))
	for i, s := range args {
		if s != "" && !strings.ContainsAny(s, " \t\n'\"\\$`|&;<>()*?[]{}!#~") {
			out[i] = s
			continue
		}
		out[i] = "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
	}
	return strings.Join(out, " ")
}
