package template

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/mountinfo"
)

var (
	suiteRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]*$`)
	// Debian policy 5.6.1 package names, with an optional :arch qualifier.
	packageRE = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?$`)
	// deb822 stanzas are separated by blank lines (possibly holding whitespace).
	blankLineRE = regexp.MustCompile(`\n\s*\n`)
)

// Apt's default source files, in the order SystemMirror consults them.
var (
	aptSourcesGlob = "/etc/apt/sources.list.d/*.sources"
	aptSourcesList = "/etc/apt/sources.list"
	aptListGlob    = "/etc/apt/sources.list.d/*.list"
)

func (d DebianSource) withDefaults() DebianSource {
	if d.Suite == "" {
		d.Suite = "bookworm"
	}
	if d.Variant == "" {
		d.Variant = "minbase"
	}
	return d
}

func (d DebianSource) validate() error {
	d = d.withDefaults()
	// Every value ends up on debootstrap's command line: the patterns also keep a value
	// from being read as an option.
	if !suiteRE.MatchString(d.Suite) {
		return errdefs.InvalidArgument("debian suite %q is invalid: use a suite or codename such as bookworm", d.Suite)
	}
	if !suiteRE.MatchString(d.Variant) {
		return errdefs.InvalidArgument("debootstrap variant %q is invalid: use minbase, buildd or fakechroot", d.Variant)
	}
	for _, p := range d.Packages {
		if !packageRE.MatchString(p) {
			return errdefs.InvalidArgument("debian package name %q is invalid: use plain package names such as python3", p)
		}
	}
	if d.Mirror != "" {
		if err := checkMirror(d.Mirror); err != nil {
			return err
		}
	}
	return nil
}

func checkMirror(m string) error {
	u, err := url.Parse(m)
	if err != nil || u.Host == "" && u.Scheme != "file" || (u.Scheme != "http" && u.Scheme != "https" && u.Scheme != "file") {
		return errdefs.InvalidArgument("debian mirror %q is invalid: use an http://, https:// or file:/// URL", m)
	}
	return nil
}

// SystemMirror returns the Debian mirror this machine's apt uses: the first non-security
// source, preferring one that carries suite. Building from the local mirror keeps builds
// working where only that mirror is reachable.
func SystemMirror(suite string) (string, error) {
	var files []string
	for _, g := range []string{aptSourcesGlob, aptSourcesList, aptListGlob} {
		m, _ := filepath.Glob(g) // only ErrBadPattern, impossible for these constants
		files = append(files, m...)
	}
	return MirrorFromSources(suite, files...)
}

// aptSource is one (URI, suites) pair from an apt source file.
type aptSource struct {
	uri    string
	suites []string
}

// MirrorFromSources picks the mirror from the given apt source files: deb822 files
// (*.sources, "URIs:" fields) and one-line files (anything else, "deb" lines). Security
// archives, deb-src-only and disabled entries are skipped. An entry listing suite (or
// suite-updates etc.) wins; otherwise the first usable entry does.
func MirrorFromSources(suite string, files ...string) (string, error) {
	var all []aptSource
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			if os.IsNotExist(err) {
				continue
			}
			return "", errdefs.FailedPrecondition("read apt sources %s: %w", f, err)
		}
		if strings.HasSuffix(f, ".sources") {
			all = append(all, parseDeb822(string(data))...)
		} else {
			all = append(all, parseOneLine(string(data))...)
		}
	}
	var first string
	for _, s := range all {
		if isSecurity(s) || checkMirror(s.uri) != nil {
			continue
		}
		if first == "" {
			first = s.uri
		}
		for _, su := range s.suites {
			if su == suite {
				return s.uri, nil
			}
		}
	}
	if first == "" {
		return "", errdefs.NotFound("no usable Debian mirror in the apt sources (%s): "+
			"set the template's Debian mirror explicitly", strings.Join(files, ", "))
	}
	return first, nil
}

func isSecurity(s aptSource) bool {
	if strings.Contains(s.uri, "security") {
		return true
	}
	for _, su := range s.suites {
		if strings.HasSuffix(su, "-security") || strings.HasSuffix(su, "/updates") {
			return true
		}
	}
	return false
}

func parseDeb822(data string) []aptSource {
	var out []aptSource
	for _, stanza := range blankLineRE.Split(data, -1) {
		fields := map[string]string{}
		var key string
		for _, line := range strings.Split(stanza, "\n") {
			if strings.HasPrefix(line, "#") {
				continue
			}
			if (strings.HasPrefix(line, " ") || strings.HasPrefix(line, "\t")) && key != "" {
				fields[key] += " " + strings.TrimSpace(line) // continuation line
				continue
			}
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			key = strings.ToLower(strings.TrimSpace(k))
			fields[key] = strings.TrimSpace(v)
		}
		if !hasWord(fields["types"], "deb") || strings.EqualFold(fields["enabled"], "no") {
			continue
		}
		suites := strings.Fields(fields["suites"])
		for _, u := range strings.Fields(fields["uris"]) {
			out = append(out, aptSource{uri: u, suites: suites})
		}
	}
	return out
}

func parseOneLine(data string) []aptSource {
	var out []aptSource
	for _, line := range strings.Split(data, "\n") {
		line, _, _ = strings.Cut(line, "#")
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") { // options: [arch=amd64 signed-by=...]
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) > 0 {
				f = f[1:]
			}
		}
		if len(f) >= 2 {
			out = append(out, aptSource{uri: f[0], suites: []string{f[1]}})
		}
	}
	return out
}

func hasWord(s, w string) bool {
	for _, f := range strings.Fields(s) {
		if f == w {
			return true
		}
	}
	return false
}

// buildDebian runs debootstrap into dir and trims the result.
func buildDebian(ctx context.Context, d DebianSource, dir string, progress Progress) (string, error) {
	d = d.withDefaults()
	if os.Geteuid() != 0 {
		return "", errdefs.PermissionDenied("building a Debian template runs debootstrap, which needs root: run cairn as root")
	}
	bin, err := exec.LookPath("debootstrap")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/debootstrap"); serr != nil {
			return "", errdefs.FailedPrecondition("debootstrap is not installed: apt-get install debootstrap")
		}
		bin = "/usr/sbin/debootstrap"
	}
	mirror := d.Mirror
	if mirror == "" {
		if mirror, err = SystemMirror(d.Suite); err != nil {
			return "", err
		}
	}
	args := []string{"--variant=" + d.Variant}
	if len(d.Packages) > 0 {
		args = append(args, "--include="+strings.Join(d.Packages, ","))
	}
	args = append(args, d.Suite, dir, mirror)
	progress.Stage("resolving")
	if err := runDebootstrap(ctx, bin, args, dir, progress); err != nil {
		return "", err
	}
	if err := finishDebian(dir); err != nil {
		return "", err
	}
	src := fmt.Sprintf("debootstrap %s (%s) from %s", d.Suite, d.Variant, mirror)
	if len(d.Packages) > 0 {
		src += " with " + strings.Join(d.Packages, ", ")
	}
	return src, nil
}

// runDebootstrap runs debootstrap in its own process group, mount and PID namespaces
// (via unshare, when available). debootstrap mounts /proc, /sys and /dev/pts inside
// the target; in a private mount namespace those mounts die with the process even when
// it is killed, instead of pinning the caller's volume. Killing the namespace's init
// takes every process of the build with it.
func runDebootstrap(ctx context.Context, bin string, args []string, dir string, progress Progress) error {
	name, argv := bin, args
	if us, err := exec.LookPath("unshare"); err == nil {
		name = us
		argv = append([]string{"--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--", bin}, args...)
	}
	cmd := exec.CommandContext(ctx, name, argv...)
	cmd.Env = append(os.Environ(), "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive",
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return errdefs.FailedPrecondition("start debootstrap: %w", err)
	}
	tracker := &debootstrapTracker{progress: progress}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			tracker.line(sc.Text())
		}
		io.Copy(io.Discard, pr) // keep draining after an over-long line
	}()
	err := cmd.Wait()
	pw.Close()
	<-done
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // stragglers of the group, if any
	unmountUnder(dir)
	if ctx.Err() != nil {
		return fmt.Errorf("debootstrap into %s interrupted: %w", dir, ctx.Err())
	}
	if err != nil {
		return classifyDebootstrap(err, tracker.tail, dir)
	}
	progress.Advance(tracker.total(), tracker.total())
	return nil
}

// debootstrapTracker turns debootstrap's "I: ..." lines into stages and an estimated
// total: every retrieved package is later validated, unpacked and configured (and some
// are extracted first), so the total is about 4 units per retrieved package plus the
// extractions seen.
type debootstrapTracker struct {
	progress  Progress
	stage     string
	retrieved int64
	extracted int64
	done      int64
	tail      []string
}

const tailLines = 50

func (t *debootstrapTracker) total() int64 { return 4*t.retrieved + t.extracted }

func (t *debootstrapTracker) line(l string) {
	t.tail = append(t.tail, l)
	if len(t.tail) > tailLines {
		t.tail = t.tail[len(t.tail)-tailLines:]
	}
	t.progress.Log(l)
	msg, ok := strings.CutPrefix(l, "I: ")
	if !ok {
		return
	}
	verb, rest, _ := strings.Cut(msg, " ")
	// "Unpacking libc6:amd64..." is one package; "Unpacking the base system..." a phase.
	count := strings.HasSuffix(rest, "...") && !strings.Contains(rest, " ")
	stage := ""
	switch verb {
	case "Retrieving", "Validating":
		// Per-package lines are "Retrieving <pkg> <version>"; "Retrieving Packages" etc.
		// are index files.
		if len(strings.Fields(rest)) != 2 {
			return
		}
		stage, count = "retrieving", true
		if verb == "Retrieving" {
			t.retrieved++
		}
	case "Extracting", "Unpacking", "Configuring":
		stage = strings.ToLower(verb)
		if verb == "Extracting" && count {
			t.extracted++
		}
	default:
		return
	}
	if stage != t.stage {
		t.stage = stage
		t.progress.Stage(stage)
	}
	if !count {
		return
	}
	t.done++
	// The estimate can lag the count (base packages are not announced at retrieval);
	// stay just short of the total until debootstrap succeeds.
	t.progress.Advance(max(0, min(t.done, t.total()-1)), t.total())
}

// classifyDebootstrap maps debootstrap's known failure messages to error classes and
// attaches the tail of its output.
func classifyDebootstrap(err error, tail []string, dir string) error {
	out := strings.Join(tail, "\n")
	if log, rerr := os.ReadFile(filepath.Join(dir, "debootstrap", "debootstrap.log")); rerr == nil {
		lines := strings.Split(strings.TrimRight(string(log), "\n"), "\n")
		out += "\n--- debootstrap.log (tail) ---\n" + strings.Join(lines[max(0, len(lines)-20):], "\n")
	}
	switch {
	case strings.Contains(out, "Couldn't find these debs"):
		return errdefs.NotFound("debootstrap failed (%v): some requested packages do not exist "+
			"in the suite; check the package names:\n%s", err, out)
	case strings.Contains(out, "No such script"):
		return errdefs.InvalidArgument("debootstrap failed (%v): unknown suite; use a Debian "+
			"codename such as bookworm:\n%s", err, out)
	case strings.Contains(out, "Failed getting release") || strings.Contains(out, "Couldn't download") ||
		strings.Contains(out, "Couldn't retrieve") || strings.Contains(out, "Failure trying to run: wget"):
		return errdefs.Unavailable("debootstrap failed (%v): the Debian mirror is unreachable "+
			"or incomplete; check network access to it, then retry:\n%s", err, out)
	}
	return &internalError{fmt.Sprintf("debootstrap failed (%v); its output ends with:\n%s", err, out)}
}

// internalError classifies as errdefs.ErrInternal without the class name in the text.
type internalError struct{ msg string }

func (e *internalError) Error() string { return e.msg }
func (e *internalError) Unwrap() error { return errdefs.ErrInternal }

// unmountUnder detaches anything still mounted below dir: a safety net for when
// debootstrap ran without a private mount namespace and was killed before its cleanup.
func unmountUnder(dir string) {
	ms, err := mountinfo.Read(0)
	if err != nil {
		return
	}
	var mps []string
	for _, m := range ms {
		if strings.HasPrefix(m.MountPoint, dir+"/") {
			mps = append(mps, m.MountPoint)
		}
	}
	for i := len(mps) - 1; i >= 0; i-- { // deepest (latest) first
		_ = unix.Unmount(mps[i], unix.MNT_DETACH)
	}
}

// finishDebian makes the fresh tree a template: a placeholder hostname, an empty
// machine-id (so every sandbox gets its own at boot instead of sharing the build's) and
// no downloaded .debs (apt clean), which are dead weight in every snapshot.
func finishDebian(dir string) error {
	steps := []struct {
		what string
		fn   func() error
	}{
		{"write /etc/hostname", func() error {
			return os.WriteFile(filepath.Join(dir, "etc/hostname"), []byte("cairn\n"), 0o644)
		}},
		{"empty /etc/machine-id", func() error {
			return os.WriteFile(filepath.Join(dir, "etc/machine-id"), nil, 0o444)
		}},
		{"clean apt archives", func() error {
			debs, _ := filepath.Glob(filepath.Join(dir, "var/cache/apt/archives/*.deb"))
			debs = append(debs, filepath.Join(dir, "var/cache/apt/archives/partial"))
			var errs []error
			for _, f := range debs {
				if err := os.RemoveAll(f); err != nil {
					errs = append(errs, err)
				}
			}
			return errors.Join(errs...)
		}},
	}
	for _, s := range steps {
		if err := s.fn(); err != nil {
			return errdefs.FailedPrecondition("finish Debian template in %s: %s: %w", dir, s.what, err)
		}
	}
	return nil
}
