package main

import (
	"bytes"
	"context"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

type logsFlags struct {
	follow, onlyOut, onlyErr bool
}

func newLogsCmd(a *app) *cobra.Command {
	var fl logsFlags
	cmd := &cobra.Command{
		Use:   "logs [flags] SANDBOX PROC",
		Short: "Print the output of a process",
		Long: `Logs prints what a process has written so far: its standard output to cairn's
standard output and its standard error to cairn's standard error. --stdout or
--stderr restricts it to one stream (printed to standard output). -f keeps following
the output until the process exits, across rollbacks of the sandbox.

After a rollback the output is the output as of the checkpoint plus what came after
the rollback.

With --json: {"handle", "stdout", "stderr", "running", "exit"} (with -f, once the
process has exited).`,
		Example: `  cairn logs $id $p
  cairn logs -f $id $p
  cairn logs --stderr $id $p | tail`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if fl.onlyOut && fl.onlyErr {
				return errdefs.InvalidArgument("give at most one of --stdout and --stderr")
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			return runLogs(a, cmd, e, args[0], args[1], fl)
		},
	}
	f := cmd.Flags()
	f.BoolVarP(&fl.follow, "follow", "f", false, "follow the output until the process exits")
	f.BoolVar(&fl.onlyOut, "stdout", false, "print only the standard output")
	f.BoolVar(&fl.onlyErr, "stderr", false, "print only the standard error")
	return cmd
}

func runLogs(a *app, cmd *cobra.Command, e client.Backend, id, h string, fl logsFlags) error {
	ctx := cmd.Context()
	var outW, errW io.Writer = cmd.OutOrStdout(), cmd.ErrOrStderr()
	var bufOut, bufErr bytes.Buffer
	switch {
	case a.json:
		outW, errW = &bufOut, &bufErr
	case fl.onlyOut:
		errW = nil
	case fl.onlyErr:
		outW, errW = nil, cmd.OutOrStdout()
	}
	if fl.follow {
		if _, err := e.Follow(ctx, id, h, outW, errW); err != nil {
			return err
		}
	} else {
		for _, s := range []struct {
			name string
			w    io.Writer
		}{{"stdout", outW}, {"stderr", errW}} {
			if err := copyOutput(ctx, e, id, h, s.name, s.w); err != nil {
				return err
			}
		}
	}
	if !a.json {
		return nil
	}
	p, err := e.Process(ctx, id, h)
	if err != nil {
		return err
	}
	doc := map[string]any{"handle": h, "running": p.Running, "exit": p.Exit}
	textOrBase64(doc, "stdout", bufOut.Bytes())
	textOrBase64(doc, "stderr", bufErr.Bytes())
	return printJSON(cmd.OutOrStdout(), doc)
}

// copyOutput writes a whole output stream of a process to w (nil: checks it exists).
func copyOutput(ctx context.Context, e client.Backend, id, h, stream string, w io.Writer) error {
	var off int64
	for {
		b, next, err := e.Output(ctx, id, h, stream, off)
		if err != nil {
			return err
		}
		if len(b) == 0 {
			return nil
		}
		if w != nil {
			if _, err := w.Write(b); err != nil {
				return err
			}
		}
		off = next
	}
}
