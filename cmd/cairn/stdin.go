package main

import (
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/errdefs"
)

func newStdinCmd(a *app) *cobra.Command {
	var noNewline, eof bool
	cmd := &cobra.Command{
		Use:   "stdin [flags] SANDBOX PROC [TEXT|-]",
		Short: "Write to the standard input of a process",
		Long: `Stdin writes TEXT followed by a newline to the standard input of a process started
with ` + "`cairn exec -d`" + `. With "-" as TEXT, cairn's own standard input is sent as is
(no newline is added). --eof closes the process's standard input after writing; TEXT
may then be left out to just close it.

The write fails if the process has exited or does not read its input.`,
		Example: `  cairn stdin $id $p 'x = 41'
  cairn stdin --no-newline $id $p 'partial'
  cat script.py | cairn stdin --eof $id $p -
  cairn stdin --eof $id $p`,
		Args: cobra.RangeArgs(2, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			var data []byte
			switch {
			case len(args) == 2 && !eof:
				return errdefs.InvalidArgument("stdin needs TEXT (or - to read cairn's standard input, or --eof to close)")
			case len(args) == 3 && args[2] == "-":
				b, err := io.ReadAll(cmd.InOrStdin())
				if err != nil {
					return err
				}
				data = b
			case len(args) == 3:
				data = []byte(args[2])
				if !noNewline {
					data = append(data, '\n')
				}
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			if err := e.Stdin(cmd.Context(), args[0], args[1], data, eof); err != nil {
				return err
			}
			return emit(a, cmd, map[string]any{"sandbox": args[0], "handle": args[1], "bytes": len(data), "eof": eof}, nil)
		},
	}
	cmd.Flags().BoolVarP(&noNewline, "no-newline", "n", false, "do not append a newline to TEXT")
	cmd.Flags().BoolVar(&eof, "eof", false, "close the process's standard input after writing")
	return cmd
}
