// Package fixup rewrites the CRIU images of a single process dumped alone — a zygote Z,
// the copy-on-write fork of a sandbox process P taken at a checkpoint — into the images
// of the process recorded in a Spec: P as it was at the checkpoint. Restoring the
// rewritten directory gives P back, with its PID.
//
// # Why the dump is not P
//
// Z is a fork of P, made at the checkpoint and kept frozen, and CRIU dumps it later. Fork
// copies memory, registers and the descriptor table, but not everything, and Z shares
// kernel objects with P, which kept running:
//
//   - Z has its own PID, and sits in P's session and process group.
//   - Open file descriptions are shared: P may have moved offsets, changed status flags
//     (O_NONBLOCK, O_APPEND), read the unread bytes out of pipes and FIFOs, renamed or
//     unlinked files (CRIU then dumps an unlinked file as a ghost, with its content at
//     the dump, or a renamed one under its new name), resized or chmodded them.
//   - POSIX record locks, the parent-death signal and the child-subreaper flag are not
//     inherited by fork.
//   - Z is stopped for the dump, and CRIU restores a task in the state it dumped it.
//
// The caller records P's side at the checkpoint (from /proc) in a Spec, and Apply makes
// the images say that.
//
// # What Apply rewrites
//
//   - pstree.img: pid, pgid, sid and the thread become Spec.Pid, so that CRIU restores
//     the task with that PID as a session and group leader (no --shell-job needed).
//   - The per-task images core-, ids-, mm-, pagemap- and fs-<pid>.img are renamed to
//     Spec.Pid. core: task state alive (stop signal dropped, and any pending SIGSTOP),
//     pdeath_sig, child_subreaper, POSIX timers that notify the old PID.
//   - files.img, through fdinfo-<files id>.img: for each Spec.Files descriptor, its
//     file entry (for a FIFO, the entry of its path) gets the path, status flags and
//     offset; the fdinfo entry its close-on-exec flag. The cwd (fs-<pid>.img), the
//     executable (mm-<pid>.img) and the file-backed mappings (mm-<pid>.img vmas, by
//     address) get their paths. Every entry given a path loses its remap
//     (remap-fpath.img) and with it its ghost (ghost-file-<id>.img) or link-remap entry
//     when nothing else uses them: the restore opens the path, which holds the
//     checkpoint's file in the checkpoint's filesystem. It also loses the size, mode
//     and build-ID CRIU checks a file against at restore: CRIU read them after the
//     checkpoint. File owners (F_SETOWN) and pidfds naming the old PID name Spec.Pid.
//   - pipes-data.img and fifo-data.img hold exactly Spec.Pipes' bytes for each listed
//     inode (CRIU keys the data by the pipe's inode, its pipe_id, a 32-bit field), with
//     a pipe size that holds them.
//   - filelocks.img: the task's POSIX locks become Spec.Locks; its flock and OFD locks,
//     which fork does share, stay and name Spec.Pid. CRIU restores locks only with
//     --file-locks.
//   - tty-info.img: a session or foreground group naming the old PID names Spec.Pid.
//
// Anything else is left as dumped: descriptors, pipes and mappings the Spec does not
// list, sockets, memory. Apply refuses what it does not know: more than one task, a
// thread, an image of an older or newer CRIU format, a parent link (apply before
// incremental.Compact), a Spec that does not fit the dump.
//
// # Dumping and restoring, as measured with CRIU 4.2.1
//
//   - CRIU refuses to dump a task that does not lead its session ("The root process N is
//     not a session leader") unless run with --shell-job (RPC ShellJob): the zygote must
//     be dumped so. The rewritten images need no --shell-job to restore.
//   - CRIU dumps the stopped zygote as TASK_STOPPED with its stop signal, and would
//     restore it stopped.
//   - A file unlinked while another name still links it is dumped only with
//     --link-remap, as a link remap to a link_remap.<id> name CRIU makes in the file's
//     directory, in the live filesystem; after a --leave-running dump CRIU unlinks that
//     name again, so such images only restore once Apply names the file's path.
//   - CRIU restores the task's PID as pstree.img says, so the PID must be free (a killed
//     process's PID is not until it is reaped). It takes the locks with F_SETLKW
//     (criu/file-lock.c): the restore waits while another process holds a conflicting
//     lock; without --file-locks it restores none.
//   - CRIU sets the parent-death signal while the restored task's parent is criu itself:
//     when criu exits after a detached restore (an RPC restore always is one) the task
//     receives that signal at once. Restored with --restore-sibling (RPC rst_sibling),
//     the task is a child of criu's parent instead, and receives nothing then.
//
// # Crash safety
//
// Apply reads and checks everything before it writes anything, so a failure leaves the
// directory as it was. Each rewritten image is written under a temporary name, synced
// and renamed into place; per-task images go to their new names first (the old ones
// stay), pstree.img is written last, and only then are the old per-task images and the
// unused ghosts removed. A crash leaves every image either old or new, never half, and
// Apply can be run again on the directory: each rewrite is idempotent, and per-task
// images of a PID pstree.img does not list are leftovers it removes.
package fixup

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/checkpoint-restore/go-criu/v8/crit"
	criu_core "github.com/checkpoint-restore/go-criu/v8/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fdinfo"
	file_lock "github.com/checkpoint-restore/go-criu/v8/crit/images/file-lock"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fs"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/inventory"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/mm"
	pipe_data "github.com/checkpoint-restore/go-criu/v8/crit/images/pipe-data"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/pstree"
	remap_file_path "github.com/checkpoint-restore/go-criu/v8/crit/images/remap-file-path"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/tty"

	"github.com/cairn-sandbox/cairn/criu/incremental"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// Spec is the process the images must become, as recorded at the checkpoint.
type Spec struct {
	Pid int // the task becomes this PID; it leads its session and process group
	// Files are the descriptors the process had open at the checkpoint that name a path
	// (as /proc/PID/fd shows it; a path ending in " (deleted)" was already unlinked then,
	// and its ghost stays). A pipe may be listed too, as "pipe:[inode]": only its flags
	// are applied. Descriptors not listed are left as dumped.
	Files []File
	Pipes []Pipe // unread content of the pipes/FIFOs the process had open, by inode
	Locks []Lock // POSIX record locks the process held (all of them)
	// Cwd and Exe are paths inside the sandbox root, absolute, at the checkpoint ("":
	// leave as dumped).
	Cwd, Exe string
	Maps     []Map // file-backed mappings: start address → path at the checkpoint
	// PdeathSig is the parent-death signal (prctl PR_GET_PDEATHSIG), 0 for none.
	PdeathSig int
	// ChildSubreaper is prctl PR_GET_CHILD_SUBREAPER: fork clears it too.
	ChildSubreaper bool
	// Dumpable, if set, is prctl PR_GET_DUMPABLE (0 or 1): the dump's is its copy's,
	// which may differ (a zygote is made non-dumpable).
	Dumpable *int
}

// File is one descriptor: its path, status flags as in /proc/PID/fdinfo (octal there:
// access mode, O_APPEND, O_NONBLOCK, O_LARGEFILE..., and O_CLOEXEC for the descriptor's
// close-on-exec flag) and offset.
type File struct {
	Fd    int
	Path  string
	Flags int
	Pos   int64
}

// Pipe is the unread content of a pipe or FIFO, named by its inode (pipe:[Ino], or the
// FIFO's inode). Empty Data: the pipe was empty.
type Pipe struct {
	Ino  uint64
	Data []byte
}

// Lock is a POSIX record lock the process held through descriptor Fd; the whole file is
// Start 0, Len 0 (Len 0 is "to the end of the file", as in struct flock).
type Lock struct {
	Fd         int
	Write      bool
	Start, Len int64
}

// Map is a file-backed mapping: the start address of its area and its path.
type Map struct {
	Start uint64
	Path  string
}

// Apply rewrites dir, the images of one process dumped alone by CRIU 4.2, in place so
// that restoring it gives the process in s. See the package doc for what changes.
//
// Preconditions: nothing else reads or writes dir (a staging directory).
func Apply(dir string, s Spec) error {
	if err := s.check(); err != nil {
		return err
	}
	d, err := load(dir, uint32(s.Pid))
	if err != nil {
		return err
	}
	if err := d.fixTask(s); err != nil {
		return err
	}
	if err := d.fixFiles(s); err != nil {
		return err
	}
	if err := d.fixPipes(s); err != nil {
		return err
	}
	if err := d.fixLocks(s); err != nil {
		return err
	}
	if err := d.write(); err != nil {
		return fmt.Errorf("rewrite images in %s: %w", dir, err)
	}
	return nil
}

// invalid is a Spec that cannot describe the dumped process.
func invalid(format string, a ...any) error {
	return errdefs.InvalidArgument("fixup: "+format, a...)
}

// unexpected is a directory Apply does not know how to rewrite.
func unexpected(dir, format string, a ...any) error {
	return errdefs.FailedPrecondition("fixup %s: %s", dir, fmt.Sprintf(format, a...))
}

func (s *Spec) check() error {
	if s.Pid <= 0 || s.Pid > 1<<22 {
		return invalid("Spec.Pid %d is not a PID", s.Pid)
	}
	fds := map[int]bool{}
	for _, f := range s.Files {
		switch {
		case f.Fd < 0 || fds[f.Fd]:
			return invalid("Spec.Files: fd %d negative or listed twice", f.Fd)
		case !strings.HasPrefix(f.Path, "/") && !strings.HasPrefix(f.Path, "pipe:["):
			return invalid("Spec.Files: fd %d: path %q is neither absolute nor pipe:[inode]", f.Fd, f.Path)
		case f.Flags < 0 || f.Pos < 0:
			return invalid("Spec.Files: fd %d: negative flags or offset", f.Fd)
		}
		fds[f.Fd] = true
	}
	inos := map[uint32]bool{}
	for _, p := range s.Pipes {
		if inos[uint32(p.Ino)] {
			return invalid("Spec.Pipes: inode %d listed twice (CRIU keys pipes by the low 32 bits of the inode)", p.Ino)
		}
		inos[uint32(p.Ino)] = true
	}
	for _, l := range s.Locks {
		if l.Fd < 0 || l.Start < 0 || l.Len < 0 {
			return invalid("Spec.Locks: lock on fd %d at %d+%d: negative", l.Fd, l.Start, l.Len)
		}
	}
	starts := map[uint64]bool{}
	for _, m := range s.Maps {
		if starts[m.Start] || !strings.HasPrefix(m.Path, "/") {
			return invalid("Spec.Maps: mapping at %#x listed twice or path %q not absolute", m.Start, m.Path)
		}
		starts[m.Start] = true
	}
	for _, p := range []string{s.Cwd, s.Exe} {
		if p != "" && !strings.HasPrefix(p, "/") {
			return invalid("Spec: cwd or exe %q is not absolute", p)
		}
	}
	if s.PdeathSig < 0 || s.PdeathSig > 64 {
		return invalid("Spec.PdeathSig %d is not a signal", s.PdeathSig)
	}
	if s.Dumpable != nil && *s.Dumpable != 0 && *s.Dumpable != 1 {
		return invalid("Spec.Dumpable %d: give 0 or 1 (what prctl(PR_SET_DUMPABLE) takes)", *s.Dumpable)
	}
	return nil
}

// dump is the decoded images directory of one task.
type dump struct {
	dir    string
	pid    uint32 // the task's PID in the images
	newPid uint32 // Spec.Pid
	// stale are temporary files and per-task images of other PIDs: what an interrupted
	// Apply leaves (CRIU writes neither).
	stale   []string
	ghosts  []string // ghost-file-*.img
	pstree  *image
	core    *image
	mm      *image
	fs      *image
	files   *image
	fdinfo  *image
	remaps  *image
	locks   *image
	pipes   *image // pipes-data.img
	fifos   *image // fifo-data.img
	ttyInfo *image
}

func load(dir string, newPid uint32) (*dump, error) {
	d := &dump{dir: dir, newPid: newPid}
	if p, err := incremental.Parent(dir); err != nil || p != "" {
		if err != nil {
			return nil, err
		}
		return nil, unexpected(dir, "it has a parent link (%s): Apply renames the task, so it must run before incremental.Compact", p)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	tasks := map[uint32][]string{}
	for _, e := range ents {
		name := e.Name()
		if strings.HasSuffix(name, tmpSuffix) {
			d.stale = append(d.stale, name)
			continue
		}
		if !strings.HasSuffix(name, ".img") {
			continue // logs, stats-dump, irmap-cache, the caller's own files
		}
		kind, prefix, pid, err := classify(name)
		if err != nil {
			return nil, unexpected(dir, "%v", err)
		}
		if kind == kindPerTask {
			tasks[pid] = append(tasks[pid], name)
		}
		if prefix == "ghost-file" {
			d.ghosts = append(d.ghosts, name)
		}
	}
	if err := d.loadTask(tasks); err != nil {
		return nil, err
	}
	return d, d.loadFiles()
}

// loadTask reads inventory, pstree and the task's own images.
func (d *dump) loadTask(tasks map[uint32][]string) error {
	inv, err := readImage(d.dir, "inventory.img", "INVENTORY", crit.CriuEntry{Message: &inventory.InventoryEntry{}}, false)
	if err != nil {
		return err
	}
	if len(inv.entries) != 1 || !inv.entries[0].Message.(*inventory.InventoryEntry).GetFdinfoPerId() {
		return unexpected(d.dir, "inventory.img is not of a CRIU >= 4.2 dump (no per-id fdinfo images)")
	}
	if d.pstree, err = readImage(d.dir, "pstree.img", "PSTREE", crit.CriuEntry{Message: &pstree.PstreeEntry{}}, false); err != nil {
		return err
	}
	if n := len(d.pstree.entries); n != 1 {
		var pids []uint32
		for _, e := range d.pstree.entries {
			pids = append(pids, e.Message.(*pstree.PstreeEntry).GetPid())
		}
		return unexpected(d.dir, "pstree.img holds %d tasks %v: Apply rewrites the images of one process dumped alone", n, pids)
	}
	t := d.pstree.entries[0].Message.(*pstree.PstreeEntry)
	d.pid = t.GetPid()
	if th := t.GetThreads(); len(th) != 1 || th[0] != d.pid {
		return unexpected(d.dir, "task %d has threads %v: Apply rewrites single-threaded processes (a fork copies only one thread)", d.pid, th)
	}
	for _, id := range []uint32{t.GetSid(), t.GetPgid()} {
		if id != d.pid && id != d.newPid {
			return invalid("task %d in %s has session %d and group %d: neither its own PID nor Spec.Pid %d, so it is not a copy of that process", d.pid, d.dir, t.GetSid(), t.GetPgid(), d.newPid)
		}
	}
	for pid, names := range tasks {
		if pid != d.pid {
			d.stale = append(d.stale, names...)
		}
	}
	sort.Strings(d.stale)
	for _, p := range []string{"core", "ids", "mm", "pagemap", "fs"} {
		if _, err := os.Stat(filepath.Join(d.dir, perTaskName(p, d.pid))); err != nil {
			return unexpected(d.dir, "task %d has no %s: %v", d.pid, perTaskName(p, d.pid), err)
		}
	}
	if d.core, err = readImage(d.dir, perTaskName("core", d.pid), "CORE", crit.CriuEntry{Message: &criu_core.CoreEntry{}}, false); err != nil {
		return err
	}
	if d.mm, err = readImage(d.dir, perTaskName("mm", d.pid), "MM", crit.CriuEntry{Message: &mm.MmEntry{}}, false); err != nil {
		return err
	}
	if d.fs, err = readImage(d.dir, perTaskName("fs", d.pid), "FS", crit.CriuEntry{Message: &fs.FsEntry{}}, false); err != nil {
		return err
	}
	ids, err := readImage(d.dir, perTaskName("ids", d.pid), "IDS", crit.CriuEntry{Message: &criu_core.TaskKobjIdsEntry{}}, false)
	if err != nil {
		return err
	}
	for _, im := range []*image{d.core, d.mm, d.fs, ids} {
		if len(im.entries) != 1 {
			return unexpected(d.dir, "%s holds %d entries, want 1", im.name, len(im.entries))
		}
	}
	filesID := ids.entries[0].Message.(*criu_core.TaskKobjIdsEntry).GetFilesId()
	d.fdinfo, err = readImage(d.dir, fmt.Sprintf("fdinfo-%d.img", filesID), "FDINFO", crit.CriuEntry{Message: &fdinfo.FdinfoEntry{}}, false)
	return err
}

// loadFiles reads the global images that describe files, pipes and locks.
func (d *dump) loadFiles() error {
	var err error
	if d.files, err = readImage(d.dir, "files.img", "FILES", crit.CriuEntry{Message: &fdinfo.FileEntry{}}, false); err != nil {
		return err
	}
	if d.remaps, err = readImage(d.dir, "remap-fpath.img", "REMAP_FPATH", crit.CriuEntry{Message: &remap_file_path.RemapFilePathEntry{}}, true); err != nil {
		return err
	}
	if d.locks, err = readImage(d.dir, "filelocks.img", "FILE_LOCKS", crit.CriuEntry{Message: &file_lock.FileLockEntry{}}, true); err != nil {
		return err
	}
	if d.pipes, err = readImage(d.dir, "pipes-data.img", "PIPES_DATA", crit.CriuEntry{Message: &pipe_data.PipeDataEntry{}}, true); err != nil {
		return err
	}
	if d.fifos, err = readImage(d.dir, "fifo-data.img", "FIFO_DATA", crit.CriuEntry{Message: &pipe_data.PipeDataEntry{}}, true); err != nil {
		return err
	}
	d.ttyInfo, err = readImage(d.dir, "tty-info.img", "TTY_INFO", crit.CriuEntry{Message: &tty.TtyInfoEntry{}}, true)
	return err
}

// write puts the rewritten images in place (see Crash safety in the package doc).
func (d *dump) write() error {
	written := map[string]bool{}
	for _, im := range []*image{d.core, d.mm, d.fs} {
		if err := im.write(d.dir, d.rename(im.name)); err != nil {
			return err
		}
		written[d.rename(im.name)] = true
	}
	for _, p := range []string{"ids", "pagemap"} {
		if old := perTaskName(p, d.pid); d.rename(old) != old {
			if err := linkImage(d.dir, old, d.rename(old)); err != nil {
				return err
			}
			written[d.rename(old)] = true
		}
	}
	for _, im := range []*image{d.files, d.fdinfo, d.remaps, d.locks, d.pipes, d.fifos, d.ttyInfo} {
		if im.changed {
			if err := im.write(d.dir, im.name); err != nil {
				return err
			}
		}
	}
	if err := syncDir(d.dir); err != nil {
		return err
	}
	if err := d.pstree.write(d.dir, d.pstree.name); err != nil {
		return err
	}
	if err := syncDir(d.dir); err != nil {
		return err
	}
	gone := append(d.stale, d.unusedGhosts()...)
	if d.pid != d.newPid {
		for p := range perTask {
			gone = append(gone, perTaskName(p, d.pid))
		}
	}
	for _, name := range gone {
		if written[name] {
			continue // a leftover of the new PID, just rewritten
		}
		if err := os.Remove(filepath.Join(d.dir, name)); err != nil && !os.IsNotExist(err) {
			return err
		}
	}
	return syncDir(d.dir)
}

// rename returns the name a per-task image of the task gets.
func (d *dump) rename(name string) string {
	if kind, prefix, pid, err := classify(name); err == nil && kind == kindPerTask && pid == d.pid {
		return perTaskName(prefix, d.newPid)
	}
	return name
}
