package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/template"
)

func newTemplateCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "template COMMAND",
		Aliases: []string{"templates"},
		Short:   "Manage templates (ls, build, import, rm)",
		Long: `Templates are the read-only root filesystems sandboxes are created from.

  cairn template ls                      list them
  cairn template build NAME              build one with debootstrap
  cairn template import NAME --dir DIR   import a directory tree
  cairn template import NAME --oci PATH  import an OCI layout or ` + "`docker save`" + ` tarball
  cairn template rm NAME                 delete one

The default template "debian" is built automatically by the first ` + "`cairn create`" + `.`,
		Example: `  cairn template ls
  cairn template build py --packages python3,python3-numpy
  cairn template import alpine --oci alpine.tar`,
		Args: cobra.NoArgs,
		RunE: showHelp,
	}
	cmd.AddCommand(newTemplateLsCmd(a), newTemplateBuildCmd(a), newTemplateImportCmd(a), newTemplateRmCmd(a))
	return cmd
}

func newTemplateLsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List templates",
		Long:    "Ls lists the templates: name, size, age and where the tree came from.",
		Example: "  cairn template ls\n  cairn template ls --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			ts, err := e.Templates(cmd.Context())
			if err != nil {
				return err
			}
			if ts == nil {
				ts = []*model.Template{}
			}
			return emit(a, cmd, ts, func(w io.Writer) error {
				t := newTable(w, "NAME", "SIZE", "CREATED", "SOURCE")
				for _, tm := range ts {
					t.row(tm.Name, humanSize(tm.Bytes), humanTime(tm.CreatedAt), tm.Source)
				}
				return t.flush()
			})
		},
	}
}

// buildTemplate builds spec and prints the template (its name as the last line).
func buildTemplate(a *app, cmd *cobra.Command, spec template.Spec) error {
	e, err := a.backend(cmd.Context())
	if err != nil {
		return err
	}
	req := client.TemplateRequest{Name: spec.Name, Dir: spec.Dir, OCI: spec.OCI}
	if d := spec.Debian; d != nil {
		req.Debian = &client.DebianSource{Suite: d.Suite, Variant: d.Variant, Packages: d.Packages, Mirror: d.Mirror}
	}
	t, err := e.BuildTemplate(cmd.Context(), req)
	if err != nil {
		return err
	}
	return emit(a, cmd, t, func(w io.Writer) error {
		_, err := fmt.Fprintln(w, t.Name)
		return err
	})
}

func newTemplateBuildCmd(a *app) *cobra.Command {
	def := template.Default().Debian
	src := template.DebianSource{}
	cmd := &cobra.Command{
		Use:   "build [flags] NAME",
		Short: "Build a Debian template with debootstrap",
		Long: `Build makes a Debian template with debootstrap, against the machine's own apt
mirror unless --mirror is given, and prints its name when done. Without flags it
builds what the default template "debian" is: bookworm, variant minbase, plus the
packages listed under --packages. --packages replaces that list.

Building takes a minute or more; progress is shown on standard error.`,
		Example: `  cairn template build debian
  cairn template build py --packages python3,python3-numpy,git
  cairn template build trixie --suite trixie --mirror http://mirror.example/debian`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return buildTemplate(a, cmd, template.Spec{Name: args[0], Debian: &src})
		},
	}
	f := cmd.Flags()
	f.StringVar(&src.Suite, "suite", def.Suite, "Debian suite")
	f.StringVar(&src.Variant, "variant", def.Variant, "debootstrap variant")
	f.StringSliceVar(&src.Packages, "packages", def.Packages, "extra packages, comma-separated")
	f.StringVar(&src.Mirror, "mirror", "", "apt mirror URL (default: the machine's first Debian source)")
	return cmd
}

func newTemplateImportCmd(a *app) *cobra.Command {
	var dir, oci string
	cmd := &cobra.Command{
		Use:   "import NAME (--dir DIR | --oci PATH)",
		Short: "Import a template from a directory tree or an OCI image",
		Long: `Import makes a template from an existing root filesystem and prints its name when
done: either a directory tree (--dir, copied with owners, modes, xattrs, hardlinks and
device nodes) or an OCI image (--oci: an OCI image layout directory or a
` + "`docker save`" + ` tarball, layers applied in order).

The tree should have the tools you will exec (a shell, python3, ...).`,
		Example: `  cairn template import debian --dir /srv/rootfs
  docker save python:3.12-slim -o py.tar && cairn template import py --oci py.tar`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (dir == "") == (oci == "") {
				return errdefs.InvalidArgument("template import needs exactly one of --dir and --oci")
			}
			return buildTemplate(a, cmd, template.Spec{Name: args[0], Dir: dir, OCI: oci})
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "directory tree to copy")
	cmd.Flags().StringVar(&oci, "oci", "", "OCI image layout directory or docker-save tarball")
	return cmd
}

func newTemplateRmCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME...",
		Short: "Delete templates",
		Long: `Rm deletes templates and prints their names. Sandboxes already created from them
are unaffected (their roots are independent snapshots).`,
		Example: "  cairn template rm py",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			e, err := a.backend(cmd.Context())
			if err != nil {
				return err
			}
			return removeAll(a, cmd, args, func(ctx context.Context, name string) error {
				return e.RemoveTemplate(ctx, name)
			})
		},
	}
}
