package main

import (
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
)

func newCreateCmd(a *app) *cobra.Command {
	var (
		opts   client.CreateRequest
		labels []string
		memory string
		ttl    time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create [flags]",
		Short: "Create and start a sandbox",
		Long: `Create makes a new sandbox from a template and starts it, then prints its ID as
the last line of standard output.

The default template "debian" (Debian bookworm with python3, git, sqlite3, procps) is
built with debootstrap the first time it is needed, which takes a minute or two;
progress is shown on standard error.`,
		Example: `  id=$(cairn create)
  cairn create --template mytools --label owner=alice --memory 512M --pids 256 --cpus 1.5
  cairn create --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if opts.Labels, err = parseLabels(labels); err != nil {
				return err
			}
			if memory != "" {
				if opts.Limits.MemoryBytes, err = parseSize(memory); err != nil {
					return err
				}
			}
			opts.TTLSeconds = int64(ttl / time.Second)
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			sb, err := e.Create(cmd.Context(), opts)
			if err != nil {
				return err
			}
			return emit(a, cmd, sb, func(w io.Writer) error {
				_, err := fmt.Fprintln(w, sb.ID)
				return err
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Template, "template", "", `template to start from (default "debian")`)
	f.StringVar(&opts.Isolation, "isolation", "", `isolation backend: gvisor or container (default gvisor where runsc is installed)`)
	f.StringArrayVarP(&labels, "label", "l", nil, "label key=value (repeatable)")
	f.StringVar(&memory, "memory", "", "memory limit, e.g. 512M or 2G (default unlimited)")
	f.Int64Var(&opts.Limits.Pids, "pids", 0, "maximum number of processes (default unlimited)")
	f.Float64Var(&opts.Limits.CPUs, "cpus", 0, "CPU quota in CPUs, e.g. 1.5 (default unlimited)")
	f.DurationVar(&ttl, "ttl", 0, "time to live, e.g. 30m (cairnd only; default: cairnd --default-ttl)")
	f.StringVar(&opts.ExpiryPolicy, "expiry", "", "at the end of the TTL: destroy or pause (cairnd only; default destroy)")
	f.StringVar(&opts.SessionID, "session", "", "session ID (cairnd only; default: a new one)")
	f.StringVar(&opts.RunID, "run", "", "run ID (cairnd only)")
	return cmd
}
