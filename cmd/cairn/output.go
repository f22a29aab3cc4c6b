package main

// Shared helpers of the commands: output (JSON, tables, human times and sizes), the
// lazy progress display, and parsing of common argument forms.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/template"
)

// printJSON writes v as one indented JSON document.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// emit prints v as JSON with --json, and otherwise calls human.
func emit(a *app, cmd *cobra.Command, v any, human func(w io.Writer) error) error {
	if a.json {
		return printJSON(cmd.OutOrStdout(), v)
	}
	if human == nil {
		return nil
	}
	return human(cmd.OutOrStdout())
}

// table writes aligned columns; call flush when done.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, headers ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)}
	if len(headers) > 0 {
		t.row(toAny(headers)...)
	}
	return t
}

func toAny(s []string) []any {
	out := make([]any, len(s))
	for i, v := range s {
		out[i] = v
	}
	return out
}

func (t *table) row(cells ...any) {
	parts := make([]string, len(cells))
	for i, c := range cells {
		parts[i] = fmt.Sprint(c)
	}
	fmt.Fprintln(t.tw, strings.Join(parts, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

// orDash shows "-" for empty cells.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// humanTime renders t relative to now ("3 minutes ago").
func humanTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := time.Since(t)
	switch {
	case d < 0:
		return t.Local().Format("2006-01-02 15:04:05")
	case d < 2*time.Second:
		return "just now"
	case d < time.Minute:
		return fmt.Sprintf("%d seconds ago", int(d.Seconds()))
	case d < 2*time.Minute:
		return "1 minute ago"
	case d < time.Hour:
		return fmt.Sprintf("%d minutes ago", int(d.Minutes()))
	case d < 2*time.Hour:
		return "1 hour ago"
	case d < 48*time.Hour:
		return fmt.Sprintf("%d hours ago", int(d.Hours()))
	}
	return fmt.Sprintf("%d days ago", int(d.Hours()/24))
}

// humanSize renders a byte count in binary units ("12.3 MiB").
func humanSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// parseSize reads "512M", "1G", "1.5GiB", "65536" (binary multiples).
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(strings.ToUpper(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "I")
	mult := int64(1)
	if t != "" {
		if i := strings.IndexByte("KMGT", t[len(t)-1]); i >= 0 {
			mult = int64(1) << (10 * (i + 1))
			t = t[:len(t)-1]
		}
	}
	f, err := strconv.ParseFloat(t, 64)
	if err != nil || f < 0 {
		return 0, errdefs.InvalidArgument("size %q: give bytes or a number with K, M, G or T (e.g. 512M)", s)
	}
	return int64(f * float64(mult)), nil
}

// parseLabels reads k=v pairs.
func parseLabels(pairs []string) (map[string]string, error) {
	if len(pairs) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" {
			return nil, errdefs.InvalidArgument("label %q: write it as key=value", p)
		}
		out[k] = v
	}
	return out, nil
}

// labelString renders labels as sorted k=v pairs joined by commas.
func labelString(l map[string]string) string {
	keys := make([]string, 0, len(l))
	for k := range l {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		keys[i] = k + "=" + l[k]
	}
	return strings.Join(keys, ",")
}

// textOrBase64 puts data in a JSON object as "content", or "content_base64" when it is
// not valid UTF-8.
func textOrBase64(m map[string]any, key string, data []byte) {
	if utf8.Valid(data) {
		m[key] = string(data)
	} else {
		m[key+"_base64"] = data // encoding/json writes []byte as base64
	}
}

// lazyProgress shows template build progress on stderr, creating the display only when
// a build actually reports something (most commands never build).
type lazyProgress struct {
	w  io.Writer
	bp *template.BarProgress
}

func (l *lazyProgress) get() *template.BarProgress {
	if l.bp == nil {
		l.bp = template.NewBarProgress(l.w)
	}
	return l.bp
}

func (l *lazyProgress) Stage(name string)         { l.get().Stage(name) }
func (l *lazyProgress) Advance(done, total int64) { l.get().Advance(done, total) }
func (l *lazyProgress) Log(line string)           { l.get().Log(line) }

func (l *lazyProgress) close(ok bool) {
	if l.bp != nil {
		l.bp.Close(ok)
	}
}

// readInput reads a file, or stdin when name is "" or "-".
func readInput(name string) ([]byte, error) {
	if name == "" || name == "-" {
		return io.ReadAll(os.Stdin)
	}
	b, err := os.ReadFile(name)
	if os.IsNotExist(err) {
		return nil, errdefs.NotFound("%s: no such file", name)
	}
	return b, err
}

// removeAll removes each name, prints the removed ones ({"removed": [...]} with --json)
// and fails like the first failure.
func removeAll(a *app, cmd *cobra.Command, names []string, rm func(context.Context, string) error) error {
	removed := []string{}
	var errs []error
	for _, n := range names {
		if err := rm(cmd.Context(), n); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, n)
	}
	if len(errs) > 0 {
		for _, n := range removed {
			fmt.Fprintln(cmd.ErrOrStderr(), "removed", n)
		}
		return firstClass(errs)
	}
	return emit(a, cmd, map[string]any{"removed": removed}, func(w io.Writer) error {
		for _, n := range removed {
			fmt.Fprintln(w, n)
		}
		return nil
	})
}

// firstClass joins errs, classified like the first of them (errors.Join would keep every
// class reachable, and errdefs would pick one by its own order).
func firstClass(errs []error) error {
	if len(errs) == 1 {
		return errs[0]
	}
	return fmt.Errorf("%w (and %d more error(s): %v)", errs[0], len(errs)-1, errors.Join(errs[1:]...))
}

// showHelp is the Run of command groups (template, files, ckpt): without a subcommand
// they print their help.
func showHelp(cmd *cobra.Command, args []string) error { return cmd.Help() }
