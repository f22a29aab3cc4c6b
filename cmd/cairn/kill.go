package main

import (
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

func newKillCmd(a *app) *cobra.Command {
	var sigName string
	cmd := &cobra.Command{
		Use:   "kill [flags] SANDBOX PROC",
		Short: "Send a signal to a process",
		Long: `Kill sends a signal (default TERM) to a process started with ` + "`cairn exec`" + ` and
to its process group. Name the signal with or without "SIG" (TERM, SIGKILL, INT,
HUP, USR1, ...) or by number.`,
		Example: `  cairn kill $id $p
  cairn kill --signal KILL $id $p
  cairn kill -s 2 $id $p`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			sig, err := parseSignal(sigName)
			if err != nil {
				return err
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			if err := e.Signal(cmd.Context(), args[0], args[1], sig); err != nil {
				return err
			}
			return emit(a, cmd, map[string]any{"sandbox": args[0], "handle": args[1], "signal": unix.SignalName(sig)}, nil)
		},
	}
	cmd.Flags().StringVarP(&sigName, "signal", "s", "TERM", "signal name or number")
	return cmd
}

// parseSignal reads "TERM", "SIGTERM", "term" or "15".
func parseSignal(s string) (syscall.Signal, error) {
	if n, err := strconv.Atoi(s); err == nil {
		if n <= 0 || n > 64 {
			return 0, errdefs.InvalidArgument("signal %d: give 1 to 64", n)
		}
		return syscall.Signal(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if sig := unix.SignalNum(name); sig != 0 {
		return sig, nil
	}
	return 0, errdefs.InvalidArgument("unknown signal %q (try TERM, KILL, INT, HUP, USR1 or a number)", s)
}
