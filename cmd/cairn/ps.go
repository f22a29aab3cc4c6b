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
	return &cobra.Command{
		Use:   "ps SANDBOX",
		Short: "List the processes started in a sandbox",
		Long: `Ps lists the processes started in a sandbox with ` + "`cairn exec`" + `, oldest first:
handle, pid (inside the sandbox), status (running, exited N, or killed by a signal),
age and command line. After a rollback it shows the processes as of the checkpoint.`,
		Example: "  cairn ps $id\n  cairn ps --json $id",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			ps, err := e.Processes(cmd.Context(), args[0])
			if err != nil {
				return err
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
