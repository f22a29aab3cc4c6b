package fixup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/checkpoint-restore/go-criu/v8/crit"
)

// tmpSuffix marks an image being written; a crash leaves at most such files, which the
// next Apply removes.
const tmpSuffix = ".fixup-tmp"

// perTask are the images CRIU >= 4.2 writes per task, named <prefix>-<pid>.img.
var perTask = map[string]bool{"core": true, "ids": true, "mm": true, "pagemap": true, "fs": true}

// legacyPerTask are per-task images of older CRIUs (now inside core or mm); images that
// have them are not of the format Apply knows.
var legacyPerTask = map[string]bool{
	"vmas": true, "sigacts": true, "itimers": true, "posix-timers": true, "creds": true,
	"rlimit": true, "signal-s": true, "signal-p": true,
}

// keyed are images named <prefix>-<n>.img where n is not a PID: a files set, a
// namespace, a mount, an inode, a pages file or a ghost file.
var keyed = map[string]bool{
	"fdinfo": true, "pagemap-shmem": true, "pagemap-secretmem": true, "utsns": true,
	"ipcns-var": true, "ipcns-shm": true, "ipcns-msg": true, "ipcns-sem": true,
	"ghost-file": true, "tcp-stream": true, "mountpoints": true, "netdev": true,
	"netns": true, "ifaddr": true, "route": true, "route6": true, "rule": true,
	"iptables": true, "ip6tables": true, "nftables": true, "tmpfs": true, "tmpfs-dev": true,
	"autofs": true, "binfmt-misc": true, "pages": true, "pages-shmem": true, "userns": true,
	"netns-ct": true, "netns-exp": true, "timens": true, "pidns": true,
}

// global are the images named without a number.
var global = map[string]bool{
	"inventory": true, "reg-files": true, "ext-files": true, "ns-files": true,
	"eventfd": true, "eventpoll": true, "eventpoll-tfd": true, "signalfd": true,
	"inotify": true, "inotify-wd": true, "fanotify": true, "fanotify-mark": true,
	"pipes": true, "pipes-data": true, "fifo": true, "fifo-data": true, "pstree": true,
	"unixsk": true, "inetsk": true, "packetsk": true, "netlinksk": true, "sk-queues": true,
	"remap-fpath": true, "memfd": true, "memfd-secret": true, "binfmt-misc": true,
	"tty": true, "tty-info": true, "tty-data": true, "filelocks": true, "tunfile": true,
	"cgroup": true, "timerfd": true, "cpuinfo": true, "seccomp": true, "files": true,
	"bpfmap-file": true, "bpfmap-data": true, "apparmor": true,
}

// imageKind is what an image's name says about it.
type imageKind int

const (
	kindOther   imageKind = iota // global or keyed by something else than a PID
	kindPerTask                  // <prefix>-<pid>.img of a current CRIU
)

// classify says what the image file name is (CRIU's criu/image-desc.c names), and for a
// per-task image its prefix and PID. Names CRIU 4.2 does not write are errors.
func classify(name string) (kind imageKind, prefix string, pid uint32, err error) {
	base := strings.TrimSuffix(name, ".img")
	base = strings.TrimSuffix(base, ".tar.gz") // tmpfs-<n>.tar.gz.img
	if global[base] {
		return kindOther, base, 0, nil
	}
	i := strings.LastIndexByte(base, '-')
	if i > 0 {
		prefix, num := base[:i], base[i+1:]
		if _, err := strconv.ParseUint(num, 16, 64); err == nil && keyed[prefix] {
			return kindOther, prefix, 0, nil // ghost-file and tcp-stream are in hex
		}
		if n, err := strconv.ParseUint(num, 10, 32); err == nil {
			switch {
			case perTask[prefix]:
				return kindPerTask, prefix, uint32(n), nil
			case legacyPerTask[prefix]:
				return 0, "", 0, fmt.Errorf("%s is a per-task image of a CRIU older than 4.2, whose images Apply does not know", name)
			}
		}
	}
	return 0, "", 0, fmt.Errorf("%s is not an image CRIU 4.2 writes for a process dumped alone (a plugin's, or a newer CRIU's?): Apply does not know whether it names the task's PID", name)
}

func perTaskName(prefix string, pid uint32) string { return fmt.Sprintf("%s-%d.img", prefix, pid) }

// image is one decoded image file of the directory.
type image struct {
	name    string // file name in the directory
	magic   string
	entries []*crit.CriuEntry
	existed bool // the file exists (a missing optional image decodes as empty)
	changed bool
}

// readImage decodes dir/name, which must have the given magic; entries are decoded into
// the type of typ.Message. A missing file is an empty image when optional.
func readImage(dir, name, magic string, typ crit.CriuEntry, optional bool) (*image, error) {
	im := &image{name: name, magic: magic}
	f, err := os.Open(filepath.Join(dir, name))
	if optional && errors.Is(err, os.ErrNotExist) {
		return im, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	img, err := crit.New(f, nil, "", false, false).Decode(typ.Message)
	if err != nil {
		return nil, fmt.Errorf("decode %s: %w", name, err)
	}
	if img.Magic != magic {
		return nil, fmt.Errorf("%s: magic %s, want %s", name, img.Magic, magic)
	}
	im.entries, im.existed = img.Entries, true
	return im, nil
}

// write writes the image to dir/name under a temporary name, syncs it and renames it
// into place. An image left without entries is removed instead: CRIU writes no empty
// images, and reads a missing one as empty.
func (im *image) write(dir, name string) error {
	path := filepath.Join(dir, name)
	if len(im.entries) == 0 {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	tmp := path + tmpSuffix
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	err = crit.New(nil, f, "", false, false).Encode(&crit.CriuImage{Magic: im.magic, Entries: im.entries})
	if err != nil {
		err = fmt.Errorf("encode %s: %w", name, err)
	} else {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// linkImage makes dir/to a hard link of dir/from (an image whose content does not
// change), replacing any dir/to atomically.
func linkImage(dir, from, to string) error {
	tmp := filepath.Join(dir, to+tmpSuffix)
	os.Remove(tmp)
	if err := os.Link(filepath.Join(dir, from), tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, to)); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
