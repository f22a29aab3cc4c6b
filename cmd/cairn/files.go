package main

import (
	"context"
	"io"
	"io/fs"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

func newFilesCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "files COMMAND",
		Short: "Read and write files of a sandbox (cat, write, ls, stat, rm)",
		Long: `Files reads and writes a sandbox's filesystem from the host, without running
anything inside it. Works on stopped sandboxes too.

  cairn files cat SANDBOX PATH                 print a file
  cairn files write SANDBOX PATH [--from F]    write a file from stdin or F
  cairn files ls SANDBOX [PATH]                list a directory
  cairn files stat SANDBOX PATH                describe a path
  cairn files rm SANDBOX PATH...               remove files or directories

Paths are absolute or relative to the sandbox's "/"; ".." is refused, and symlinks
pointing out of the sandbox are not followed out of it.`,
		Example: `  cairn files cat $id /etc/os-release
  echo 'print("hi")' | cairn files write $id /workspace/hi.py
  cairn files ls $id /workspace`,
		Args: cobra.NoArgs,
		RunE: showHelp,
	}
	cmd.AddCommand(newFilesCatCmd(a), newFilesWriteCmd(a), newFilesLsCmd(a), newFilesStatCmd(a), newFilesRmCmd(a))
	return cmd
}

func newFilesCatCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "cat SANDBOX PATH",
		Short: "Print a file of a sandbox",
		Long: `Cat prints a file of a sandbox (up to 256 MiB) to standard output, byte for byte.
With --json: {"path", "size", "content"} ("content_base64" if not UTF-8).`,
		Example: "  cairn files cat $id /etc/hostname",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			b, err := e.ReadFile(cmd.Context(), args[0], args[1])
			if err != nil {
				return err
			}
			doc := map[string]any{"path": args[1], "size": len(b)}
			textOrBase64(doc, "content", b)
			return emit(a, cmd, doc, func(w io.Writer) error {
				_, err := w.Write(b)
				return err
			})
		},
	}
}

func newFilesWriteCmd(a *app) *cobra.Command {
	var from, mode string
	cmd := &cobra.Command{
		Use:   "write [flags] SANDBOX PATH",
		Short: "Write a file of a sandbox from stdin or a host file",
		Long: `Write replaces a file of a sandbox (atomically, creating parent directories) with
cairn's standard input, or with the host file given by --from. Prints nothing (the
file's description with --json).`,
		Example: `  echo hello | cairn files write $id /workspace/greeting
  cairn files write --from ./main.py --mode 0755 $id /workspace/main.py`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			perm, err := strconv.ParseUint(mode, 8, 32)
			if err != nil || perm > 0o7777 {
				return errdefs.InvalidArgument("mode %q: give octal permissions like 0644", mode)
			}
			data, err := readInput(from)
			if err != nil {
				return err
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			fi, err := e.WriteFile(cmd.Context(), args[0], args[1], data, fs.FileMode(perm))
			if err != nil || !a.json {
				return err
			}
			return printJSON(cmd.OutOrStdout(), fi)
		},
	}
	cmd.Flags().StringVar(&from, "from", "", "host file to copy (default: standard input)")
	cmd.Flags().StringVar(&mode, "mode", "0644", "permissions of the file, in octal")
	return cmd
}

func newFilesLsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "ls SANDBOX [PATH]",
		Short: "List a directory of a sandbox",
		Long:  `Ls lists a directory of a sandbox (default "/"): mode, size, modification time and name.`,
		Example: `  cairn files ls $id
  cairn files ls --json $id /workspace`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			p := "/"
			if len(args) == 2 {
				p = args[1]
			}
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			list, err := e.ListDir(cmd.Context(), args[0], p)
			if err != nil {
				return err
			}
			return emit(a, cmd, list, func(w io.Writer) error {
				t := newTable(w)
				for _, fi := range list {
					t.row(fileRow(fi)...)
				}
				return t.flush()
			})
		},
	}
}

func fileRow(fi *model.FileInfo) []any {
	name := fi.Name
	if fi.Link != "" {
		name += " -> " + fi.Link
	}
	return []any{fi.Mode, fi.Size, fi.ModTime.Local().Format("2006-01-02 15:04"), name}
}

func newFilesStatCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "stat SANDBOX PATH",
		Short:   "Describe a path of a sandbox",
		Long:    "Stat describes a path of a sandbox (a symlink itself, not its target).",
		Example: "  cairn files stat $id /etc/apt",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			fi, err := e.Stat(cmd.Context(), args[0], args[1])
			if err != nil {
				return err
			}
			return emit(a, cmd, fi, func(w io.Writer) error {
				return kv(w, "Path", fi.Path, "Mode", fi.Mode, "Size", strconv.FormatInt(fi.Size, 10),
					"Modified", fi.ModTime.Local().Format("2006-01-02 15:04:05"), "Link", orDash(fi.Link))
			})
		},
	}
}

func newFilesRmCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "rm SANDBOX PATH...",
		Short:   "Remove files or directories of a sandbox",
		Long:    "Rm removes paths of a sandbox, directories recursively, and prints each removed path.",
		Example: "  cairn files rm $id /workspace/tmp /workspace/out.log",
		Args:    cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			return removeAll(a, cmd, args[1:], func(ctx context.Context, p string) error {
				return e.RemovePath(ctx, args[0], p)
			})
		},
	}
}
