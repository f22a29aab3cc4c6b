package incremental

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// Sharing: the other way to store a child's images. Where the images live on a
// filesystem with reflinks (btrfs), a full directory need not become incremental to stop
// holding a copy of its parent's pages: Share makes each page equal to the parent's
// logical page at the same address share the parent's data on disk (FICLONERANGE) and
// writes only the others. The directory stays full and standalone: its pagemaps are
// untouched, a restore reads it as fast as any full one (no chain to walk), and deleting
// its parent, or itself, breaks nothing (the filesystem counts the extents' references).
// There is no depth to bound: a child of a shared directory shares in turn.
//
// Each task's pages file is rebuilt beside the old one (same layout: the present
// entries' pages back to back) and renamed over it. A crash leaves the old file or the
// new one, both with the same content, and at most a temporary file, which Sweep removes.
// A restore reading the directory meanwhile needs no lock: every version of the file
// holds the same bytes.

// ErrNoReflink says that Share cannot share data between the two directories: they are
// not on one filesystem that supports reflinks. The directory is left as it was.
var ErrNoReflink = errors.New("images cannot share data here: no reflinks between them (they must be on one btrfs filesystem)")

// ShareOptions are the options of Share.
type ShareOptions struct {
	// Compress asks the filesystem to compress the pages Share writes (btrfs zstd); the
	// shared ones keep their parent's encoding. A restore decompresses them.
	Compress bool
}

// ShareResult says what Share did (or, for a directory already shared, what it had
// done: Tasks is then 0).
type ShareResult struct {
	Tasks       int   `json:"-"`            // pages files rebuilt
	SharedPages int64 `json:"shared_pages"` // pages sharing the parent's data
	OwnPages    int64 `json:"own_pages"`    // pages written (differing from the parent's, or absent there)
}

// SharedMarker is the file Share leaves in a directory it completed, with its
// ShareResult: a second Share returns that at once.
const SharedMarker = "shared.json"

// SharedBytes is what the directory's pages share with the parent's.
func (r ShareResult) SharedBytes() int64 { return r.SharedPages * pageSize }

// Share rebuilds the pages files of the full images directory dir so that each page
// equal to parent's logical page (same task, same address; parent full or incremental)
// shares parent's data. dir must be full (no parent link). It returns ErrNoReflink,
// leaving dir as it was, when the filesystem cannot share data between them.
func Share(dir, parent string, opt ShareOptions) (res ShareResult, err error) {
	dir, parent = filepath.Clean(dir), filepath.Clean(parent)
	release, err := lockDir(dir, unix.LOCK_EX)
	if err != nil {
		return res, err
	}
	defer release()
	if cur, err := Parent(dir); err != nil || cur != "" {
		if err == nil {
			err = fmt.Errorf("images directory %s is incremental (against %s): Share takes a full one", dir, cur)
		}
		return res, err
	}
	if b, err := os.ReadFile(filepath.Join(dir, SharedMarker)); err == nil {
		if err := json.Unmarshal(b, &res); err != nil {
			return res, fmt.Errorf("%s: %w", filepath.Join(dir, SharedMarker), err)
		}
		return res, nil
	}
	releaseChain, err := lockChain(parent)
	if err != nil {
		return res, err
	}
	defer releaseChain()
	defer func() {
		if err != nil {
			removeLeftovers(dir)
		}
	}()
	tasks, err := taskIDs(dir)
	if err != nil {
		return res, err
	}
	for _, id := range tasks {
		if err := shareTask(dir, parent, id, opt, &res); err != nil {
			return res, err
		}
	}
	b, err := json.Marshal(res)
	if err != nil {
		return res, err
	}
	marker := filepath.Join(dir, SharedMarker)
	if err := os.WriteFile(tmpName(marker), b, 0o600); err != nil {
		return res, err
	}
	if err := os.Rename(tmpName(marker), marker); err != nil {
		return res, err
	}
	return res, syncDir(dir)
}

// shareTask rebuilds the pages file of task id of dir against parent's same task.
func shareTask(dir, parent, id string, opt ShareOptions, res *ShareResult) error {
	m, err := openTask(dir, id)
	if err != nil || m == nil || m.pages == nil {
		return err
	}
	defer m.close()
	p, err := openTask(parent, id)
	if err != nil || p == nil {
		return err
	}
	defer p.close()
	path := filepath.Join(dir, pagesName(m.pagesID))
	tmp := tmpName(path)
	os.Remove(tmp) // a leftover of a crashed Share; dir is locked
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	own := &pack{dir: dir, dst: f}
	defer own.close()
	if opt.Compress && own.open() != nil {
		// Best effort: a filesystem without it writes them in place, as they are.
		unix.Fsetxattr(int(f.Fd()), "btrfs.compression", []byte("zstd"), 0)
	}
	shared, owned, err := rebuildPages(m, p, f, own)
	if err == nil {
		err = own.flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		crashPoint("share-pages")
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	res.Tasks++
	res.SharedPages += shared
	res.OwnPages += owned
	return nil
}

// chunkBufs are rebuildPages's two buffers of a chunk: made for each task, they were a
// quarter of what cairn allocated in W1 (package memtune).
var chunkBufs = sync.Pool{New: func() any {
	return &[2][]byte{make([]byte, chunk*pageSize), make([]byte, chunk*pageSize)}
}}

// rebuildPages writes m's pages into f at their offsets: runs equal to p's logical
// pages as clones of p's data, the others through w.
func rebuildPages(m, p *taskMap, f *os.File, w *pack) (shared, own int64, err error) {
	bufs := chunkBufs.Get().(*[2][]byte)
	defer chunkBufs.Put(bufs)
	mine, theirs := bufs[0], bufs[1]
	for _, e := range m.entries {
		if !hasFlag(e.flags, pePresent) {
			continue
		}
		for done := uint64(0); done < e.nr; {
			n := min(e.nr-done, chunk)
			va := e.vaddr + done*pageSize
			off := e.off + int64(done*pageSize)
			buf := mine[:n*pageSize]
			if err := readAt(m.pages, buf, off); err != nil {
				return shared, own, err
			}
			for i := uint64(0); i < n; {
				s := p.lookup(va+i*pageSize, true)
				k := min(s.run, n-i)
				if s.kind != inFile {
					if err := w.writeAt(buf[i*pageSize:(i+k)*pageSize], off+int64(i*pageSize)); err != nil {
						return shared, own, err
					}
					own += int64(k)
					i += k
					continue
				}
				b := theirs[:k*pageSize]
				if err := readAt(s.file, b, s.off); err != nil {
					return shared, own, err
				}
				// Runs of equal pages are cloned, runs of different ones written; each
				// page is compared once.
				same := func(j uint64) bool {
					return bytes.Equal(b[j*pageSize:(j+1)*pageSize], buf[(i+j)*pageSize:(i+j+1)*pageSize])
				}
				eq := same(0)
				for j := uint64(0); j < k; {
					l, next := j+1, eq
					for ; l < k; l++ {
						if next = same(l); next != eq {
							break
						}
					}
					dst := off + int64((i+j)*pageSize)
					if eq {
						if err := cloneRange(f, s.file, s.off+int64(j*pageSize), dst, int64((l-j)*pageSize)); err != nil {
							return shared, own, err
						}
						shared += int64(l - j)
					} else {
						if err := w.writeAt(buf[(i+j)*pageSize:(i+l)*pageSize], dst); err != nil {
							return shared, own, err
						}
						own += int64(l - j)
					}
					j, eq = l, next
				}
				i += k
			}
			done += n
		}
	}
	return shared, own, nil
}

// A pack puts a pages file's own pages (those not shared with the parent) at their
// offsets: in place, or, once open, gathered back to back in compressed anonymous files
// (O_TMPFILE: nothing is left if cairn dies) and then clones each run into place. In
// place, the own pages are mostly runs of a page or two between shared ones, and btrfs
// cannot compress an extent of one page (it must save a whole block); back to back they
// fill compressed extents, which the pages file then shares. Each packChunk bytes go to
// a file of their own, written back alone: btrfs decides from a sample of each range
// it writes back (up to 512 KiB) whether to compress it, and a range where random bytes
// (which a process wrote and freed, say) sit beside compressible pages is written
// uncompressed whole (W1: none of a checkpoint's own pages compressed in one file of
// 1.8 MB, half of them in files of 128 KiB). A read of one page decompresses its
// extent up to that page.
type pack struct {
	dir    string
	dst, f *os.File // f: the pack file, nil when writing in place
	size   int64
	runs   []packRun
}

// packChunk is the most own pages one compressed pack file holds.
const packChunk = 128 << 10

// packRun is a run of own pages: n bytes at off in the pack go to dst in the pages file.
type packRun struct{ off, dst, n int64 }

// open starts a pack file.
func (k *pack) open() error {
	fd, err := unix.Open(k.dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	if err := unix.Fsetxattr(fd, "btrfs.compression", []byte("zstd"), 0); err != nil {
		unix.Close(fd)
		return err
	}
	k.f, k.size, k.runs = os.NewFile(uintptr(fd), filepath.Join(k.dir, "(pack)")), 0, k.runs[:0]
	return nil
}

func (k *pack) writeAt(b []byte, dst int64) error {
	if k.f == nil {
		_, err := k.dst.WriteAt(b, dst)
		return err
	}
	for len(b) > 0 {
		if k.size == packChunk {
			if err := k.flush(); err != nil {
				return err
			}
			k.close()
			if err := k.open(); err != nil {
				return err
			}
		}
		n := int64(min(int64(len(b)), packChunk-k.size))
		if _, err := k.f.WriteAt(b[:n], k.size); err != nil {
			return err
		}
		if l := len(k.runs) - 1; l >= 0 && k.runs[l].off+k.runs[l].n == k.size && k.runs[l].dst+k.runs[l].n == dst {
			k.runs[l].n += n
		} else {
			k.runs = append(k.runs, packRun{off: k.size, dst: dst, n: n})
		}
		k.size += n
		b, dst = b[n:], dst+n
	}
	return nil
}

// flush writes the pack file back (compressing it) and clones its runs into place.
func (k *pack) flush() error {
	if len(k.runs) == 0 {
		return nil
	}
	if err := unix.Fdatasync(int(k.f.Fd())); err != nil {
		return fmt.Errorf("write back the own pages of %s: %w", k.dst.Name(), err)
	}
	for _, r := range k.runs {
		if err := cloneRange(k.dst, k.f, r.off, r.dst, r.n); err != nil {
			return err
		}
	}
	k.runs = k.runs[:0]
	return nil
}

func (k *pack) close() {
	if k.f != nil {
		k.f.Close()
		k.f = nil
	}
}

// cloneRange makes n bytes of dst at dstOff share src's data at srcOff.
func cloneRange(dst, src *os.File, srcOff, dstOff, n int64) error {
	err := unix.IoctlFileCloneRange(int(dst.Fd()), &unix.FileCloneRange{
		Src_fd: int64(src.Fd()), Src_offset: uint64(srcOff), Src_length: uint64(n), Dest_offset: uint64(dstOff)})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EINVAL):
		return fmt.Errorf("%w: clone %s into %s: %v", ErrNoReflink, src.Name(), dst.Name(), err)
	}
	return fmt.Errorf("clone %s into %s: %w", src.Name(), dst.Name(), err)
}
