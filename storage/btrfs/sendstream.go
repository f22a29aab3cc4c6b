package btrfs

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The btrfs send stream, version 1 (fs/btrfs/send.h in the kernel), and the other
// kernel interfaces Revert uses besides those of ioctl.go: the send, inode lookup and
// inode generation ioctls, and FIEMAP with the comparison of its extents.
//
// A stream is a header ("btrfs-stream\0" and a little-endian u32 version) followed by
// commands. A command is a 10-byte header (u32 length of its attributes, u16 command,
// u32 crc32c of the whole command computed with the crc field zeroed) and then its
// attributes as TLVs (u16 type, u16 length, data). In version 1 no command exceeds 64 KiB
// and every attribute appears at most once per command.

const (
	sendStreamMagic   = "btrfs-stream\x00"
	sendStreamVersion = 1
	sendCmdHeaderLen  = 10
	sendTLVHeaderLen  = 4

	// sendFlagNoFileData is BTRFS_SEND_FLAG_NO_FILE_DATA: the stream carries
	// UPDATE_EXTENT (path, offset, length) instead of WRITE and its data.
	sendFlagNoFileData = 0x1
)

// Commands (enum btrfs_send_cmd). Their numbers are part of the stream format.
const (
	sendCmdSubvol       = 1
	sendCmdSnapshot     = 2
	sendCmdMkfile       = 3
	sendCmdMkdir        = 4
	sendCmdMknod        = 5
	sendCmdMkfifo       = 6
	sendCmdMksock       = 7
	sendCmdSymlink      = 8
	sendCmdRename       = 9
	sendCmdLink         = 10
	sendCmdUnlink       = 11
	sendCmdRmdir        = 12
	sendCmdSetXattr     = 13
	sendCmdRemoveXattr  = 14
	sendCmdWrite        = 15
	sendCmdClone        = 16
	sendCmdTruncate     = 17
	sendCmdChmod        = 18
	sendCmdChown        = 19
	sendCmdUtimes       = 20
	sendCmdEnd          = 21
	sendCmdUpdateExtent = 22
	sendCmdMaxV1        = sendCmdUpdateExtent
)

var sendCmdNames = [...]string{
	sendCmdSubvol: "subvol", sendCmdSnapshot: "snapshot", sendCmdMkfile: "mkfile",
	sendCmdMkdir: "mkdir", sendCmdMknod: "mknod", sendCmdMkfifo: "mkfifo",
	sendCmdMksock: "mksock", sendCmdSymlink: "symlink", sendCmdRename: "rename",
	sendCmdLink: "link", sendCmdUnlink: "unlink", sendCmdRmdir: "rmdir",
	sendCmdSetXattr: "set_xattr", sendCmdRemoveXattr: "remove_xattr", sendCmdWrite: "write",
	sendCmdClone: "clone", sendCmdTruncate: "truncate", sendCmdChmod: "chmod",
	sendCmdChown: "chown", sendCmdUtimes: "utimes", sendCmdEnd: "end",
	sendCmdUpdateExtent: "update_extent",
}

// Attributes (the anonymous attribute enum of send.h).
const (
	sendAttrUUID          = 1
	sendAttrCtransid      = 2
	sendAttrIno           = 3
	sendAttrSize          = 4
	sendAttrMode          = 5
	sendAttrUID           = 6
	sendAttrGID           = 7
	sendAttrRdev          = 8
	sendAttrCtime         = 9
	sendAttrMtime         = 10
	sendAttrAtime         = 11
	sendAttrOtime         = 12
	sendAttrXattrName     = 13
	sendAttrXattrData     = 14
	sendAttrPath          = 15
	sendAttrPathTo        = 16
	sendAttrPathLink      = 17
	sendAttrFileOffset    = 18
	sendAttrData          = 19
	sendAttrCloneUUID     = 20
	sendAttrCloneCtransid = 21
	sendAttrClonePath     = 22
	sendAttrCloneOffset   = 23
	sendAttrCloneLen      = 24
	sendAttrMaxV1         = sendAttrCloneLen
)

// sendCommand is one decoded command. attrs[t] is the value of attribute t, or nil if
// the command does not carry it; the slices share buf.
type sendCommand struct {
	cmd   uint16
	buf   []byte
	attrs [sendAttrMaxV1 + 1][]byte
	// exact marks a data range of a tree plan: already narrowed to what differs, so
	// the applier does not compare extents again.
	exact bool
}

func (c *sendCommand) String() string {
	name := "unknown"
	if int(c.cmd) < len(sendCmdNames) && sendCmdNames[c.cmd] != "" {
		name = sendCmdNames[c.cmd]
	}
	s := name
	for _, a := range []int{sendAttrPath, sendAttrPathTo, sendAttrPathLink} {
		if v := c.attrs[a]; v != nil {
			s += fmt.Sprintf(" %q", v)
		}
	}
	if v, err := c.u64(sendAttrFileOffset); err == nil {
		s += fmt.Sprintf(" offset=%d", v)
	}
	if v, err := c.u64(sendAttrSize); err == nil {
		s += fmt.Sprintf(" size=%d", v)
	}
	return s
}

// errSendStream marks a stream that does not decode: a kernel that speaks another
// format, or a bug here. It is never the caller's fault.
var errSendStream = errors.New("malformed btrfs send stream")

func (c *sendCommand) attr(t int) ([]byte, error) {
	v := c.attrs[t]
	if v == nil {
		return nil, fmt.Errorf("%w: %s without attribute %d", errSendStream, c, t)
	}
	return v, nil
}

func (c *sendCommand) str(t int) (string, error) {
	v, err := c.attr(t)
	return string(v), err
}

func (c *sendCommand) u64(t int) (uint64, error) {
	v := c.attrs[t]
	if len(v) != 8 {
		return 0, fmt.Errorf("%w: command %d: attribute %d has %d bytes, want 8", errSendStream, c.cmd, t, len(v))
	}
	return binary.LittleEndian.Uint64(v), nil
}

// timespec decodes struct btrfs_timespec: u64 seconds, u32 nanoseconds.
func (c *sendCommand) timespec(t int) (unix.Timespec, error) {
	v := c.attrs[t]
	if len(v) != 12 {
		return unix.Timespec{}, fmt.Errorf("%w: %s: time attribute %d has %d bytes, want 12", errSendStream, c, t, len(v))
	}
	return unix.Timespec{
		Sec:  int64(binary.LittleEndian.Uint64(v)),
		Nsec: int64(binary.LittleEndian.Uint32(v[8:])),
	}, nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crc32cRaw is the kernel's crc32c(0, p): seed 0 and no final inversion, unlike
// crc32.Checksum, which starts from and ends with an inversion.
func crc32cRaw(p []byte) uint32 {
	return ^crc32.Update(^uint32(0), castagnoli, p)
}

// readSendStream decodes a version 1 stream from r and calls fn for every command up to
// and including END; it fails if anything but the end of r follows END, if r ends
// before END, or if a command's checksum does not match.
func readSendStream(r io.Reader, fn func(*sendCommand) error) error {
	var hdr [len(sendStreamMagic) + 4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return fmt.Errorf("%w: reading the header: %w", errSendStream, err)
	}
	if !bytes.Equal(hdr[:len(sendStreamMagic)], []byte(sendStreamMagic)) {
		return fmt.Errorf("%w: bad magic %q", errSendStream, hdr[:len(sendStreamMagic)])
	}
	if v := binary.LittleEndian.Uint32(hdr[len(sendStreamMagic):]); v != sendStreamVersion {
		return fmt.Errorf("%w: version %d, want %d", errSendStream, v, sendStreamVersion)
	}
	for {
		c, err := readSendCommand(r)
		if err != nil {
			return err
		}
		if err := fn(c); err != nil {
			return err
		}
		if c.cmd == sendCmdEnd {
			break
		}
	}
	var one [1]byte
	if n, err := r.Read(one[:]); n != 0 || (err != nil && err != io.EOF) {
		return fmt.Errorf("%w: data after the end command (%v)", errSendStream, err)
	}
	return nil
}

// readSendCommand reads, checks and decodes one command.
func readSendCommand(r io.Reader) (*sendCommand, error) {
	var h [sendCmdHeaderLen]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF // the stream must end with END
		}
		return nil, fmt.Errorf("%w: reading a command header: %w", errSendStream, err)
	}
	n := binary.LittleEndian.Uint32(h[0:4])
	if n > 1<<20 { // v1 commands fit in the kernel's 64 KiB send buffer
		return nil, fmt.Errorf("%w: command of %d bytes", errSendStream, n)
	}
	buf := make([]byte, sendCmdHeaderLen+int(n))
	copy(buf, h[:])
	if _, err := io.ReadFull(r, buf[sendCmdHeaderLen:]); err != nil {
		return nil, fmt.Errorf("%w: reading a command: %w", errSendStream, err)
	}
	want := binary.LittleEndian.Uint32(h[6:10])
	clear(buf[6:10])
	if got := crc32cRaw(buf); got != want {
		return nil, fmt.Errorf("%w: command checksum %#08x, want %#08x", errSendStream, got, want)
	}
	c := &sendCommand{cmd: binary.LittleEndian.Uint16(h[4:6]), buf: buf}
	if c.cmd == 0 || c.cmd > sendCmdMaxV1 {
		return nil, fmt.Errorf("%w: unknown command %d", errSendStream, c.cmd)
	}
	for p := buf[sendCmdHeaderLen:]; len(p) > 0; {
		if len(p) < sendTLVHeaderLen {
			return nil, fmt.Errorf("%w: %s: truncated attribute", errSendStream, c)
		}
		t, l := binary.LittleEndian.Uint16(p), int(binary.LittleEndian.Uint16(p[2:]))
		p = p[sendTLVHeaderLen:]
		if t == 0 || t > sendAttrMaxV1 || l > len(p) {
			return nil, fmt.Errorf("%w: command %d: bad attribute %d of %d bytes", errSendStream, c.cmd, t, l)
		}
		c.attrs[t] = p[:l:l]
		p = p[l:]
	}
	return c, nil
}

// sendArgs is struct btrfs_ioctl_send_args.
type sendArgs struct {
	sendFd            int64
	cloneSourcesCount uint64
	cloneSources      uintptr // __u64 __user *
	parentRoot        uint64
	flags             uint64
	version           uint32
	reserved          [28]byte
}

// inoLookupArgs is struct btrfs_ioctl_ino_lookup_args.
type inoLookupArgs struct {
	treeID   uint64
	objectID uint64
	name     [4080]byte
}

// inoPathArgs is struct btrfs_ioctl_ino_path_args; fspath points at a struct
// btrfs_data_container (u32 bytes_left, bytes_missing, elem_cnt, elem_missed; then
// elem_cnt u64 offsets, relative to the first of them, of NUL-terminated paths).
type inoPathArgs struct {
	inum     uint64
	size     uint64
	reserved [4]uint64
	fspath   uintptr
}

var (
	_ [unsafe.Sizeof(sendArgs{}) - 72]struct{}
	_ [72 - unsafe.Sizeof(sendArgs{})]struct{}
	_ [unsafe.Sizeof(inoLookupArgs{}) - 4096]struct{}
	_ [4096 - unsafe.Sizeof(inoLookupArgs{})]struct{}
	_ [unsafe.Sizeof(inoPathArgs{}) - 56]struct{}
	_ [56 - unsafe.Sizeof(inoPathArgs{})]struct{}
)

var (
	iocInoLookup = ioc(iocRead|iocWrite, 18, unsafe.Sizeof(inoLookupArgs{})) // BTRFS_IOC_INO_LOOKUP
	iocInoPaths  = ioc(iocRead|iocWrite, 35, unsafe.Sizeof(inoPathArgs{}))   // BTRFS_IOC_INO_PATHS
	iocSend      = ioc(iocWrite, 38, unsafe.Sizeof(sendArgs{}))              // BTRFS_IOC_SEND
)

// fsIocGetversion is FS_IOC_GETVERSION, _IOR('v', 1, long): the inode's generation.
const fsIocGetversion = 2<<30 | 8<<16 | 'v'<<8 | 1

// rootID returns the id of the subvolume (tree) that holds the open file fd.
func rootID(fd int) (uint64, error) {
	a := inoLookupArgs{objectID: btrfsFirstFreeObjectID}
	err := ioctl(fd, iocInoLookup, unsafe.Pointer(&a))
	return a.treeID, err
}

// inodeGeneration returns the generation of the inode open as fd. An inode number
// is reused only with another generation, so the pair names one inode for good.
func inodeGeneration(fd int) (uint64, error) {
	var g uint64
	err := ioctl(fd, fsIocGetversion, unsafe.Pointer(&g))
	return g, err
}

// inodePath returns one path, relative to the root of the subvolume of fd, of the inode
// ino of that subvolume; buf is scratch space (at least 8 KiB, reused across calls).
// It fails with ENOENT if the inode has no name.
func inodePath(fd int, ino uint64, buf []uint64) (string, error) {
	a := inoPathArgs{inum: ino, size: uint64(len(buf) * 8), fspath: uintptr(unsafe.Pointer(&buf[0]))}
	if err := ioctl(fd, iocInoPaths, unsafe.Pointer(&a)); err != nil {
		return "", err
	}
	b := unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), len(buf)*8)
	cnt := binary.NativeEndian.Uint32(b[8:12])
	if cnt == 0 {
		return "", unix.ENOENT
	}
	vals := b[16:]
	off := binary.NativeEndian.Uint64(vals)
	if off >= uint64(len(vals)) {
		return "", fmt.Errorf("BTRFS_IOC_INO_PATHS returned offset %d beyond its buffer", off)
	}
	return cstr(vals[off:]), nil
}

// sendDiff runs BTRFS_IOC_SEND on the read-only subvolume sendfd with parentRoot as the
// parent, in no-data mode, and returns its commands (END excluded). The ioctl writes
// into a pipe from another goroutine while this one decodes, since the kernel blocks
// once the pipe is full.
//
// Preconditions: sendfd's subvolume and parentRoot are read-only, and stay so until
// sendDiff returns (the kernel refuses to start otherwise).
func sendDiff(sendfd int, parentRoot uint64) ([]*sendCommand, error) {
	var pfd [2]int
	if err := unix.Pipe2(pfd[:], unix.O_CLOEXEC); err != nil {
		return nil, fmt.Errorf("pipe for the send stream: %w", err)
	}
	// A bigger pipe means fewer context switches between the kernel's writer and us;
	// the size is best effort (capped by /proc/sys/fs/pipe-max-size).
	_, _ = unix.FcntlInt(uintptr(pfd[1]), unix.F_SETPIPE_SZ, 1<<20)
	done := make(chan error, 1)
	go func() {
		a := sendArgs{sendFd: int64(pfd[1]), parentRoot: parentRoot, flags: sendFlagNoFileData}
		err := ioctl(sendfd, iocSend, unsafe.Pointer(&a))
		unix.Close(pfd[1]) // EOF for the reader
		done <- err
	}()
	r := os.NewFile(uintptr(pfd[0]), "btrfs send stream")
	var cmds []*sendCommand
	perr := readSendStream(bufio.NewReaderSize(r, 1<<16), func(c *sendCommand) error {
		if c.cmd != sendCmdEnd {
			cmds = append(cmds, c)
		}
		return nil
	})
	// Closing the read end on a decoding error makes the kernel's next write fail with
	// EPIPE, so the ioctl returns instead of blocking on a pipe nobody drains. (Go
	// ignores the SIGPIPE that comes with it: the descriptor is not stdout or stderr.)
	r.Close()
	serr := <-done
	if serr != nil {
		if perr != nil && serr == unix.EPIPE {
			return nil, perr
		}
		return nil, serr
	}
	return cmds, perr
}

// FS_IOC_FIEMAP (include/uapi/linux/fiemap.h): struct fiemap is a 32-byte header
// followed by fm_extent_count struct fiemap_extent of 56 bytes.
const (
	fiemapHeaderLen = 32
	fiemapExtentLen = 56
	fsIocFiemap     = (iocRead|iocWrite)<<30 | fiemapHeaderLen<<16 | 'f'<<8 | 11

	fiemapFlagSync   = 0x1 // FIEMAP_FLAG_SYNC
	fiemapExtentLast = 0x1 // FIEMAP_EXTENT_LAST
	// Extents whose physical address does not map file offsets one to one, or whose
	// data is not (yet) where it says: FIEMAP_EXTENT_UNKNOWN, _DELALLOC, _ENCODED,
	// _DATA_ENCRYPTED, _NOT_ALIGNED, _DATA_INLINE, _DATA_TAIL, _UNWRITTEN.
	fiemapExtentOpaque = 0x2 | 0x4 | 0x8 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800
)

// extent is one mapped range of a file: [logical, logical+length) of the file is at
// physical in the filesystem's address space.
type extent struct {
	logical, physical, length int64
	flags                     uint32
}

// fileExtents returns the extents of the open file fd that overlap [off, end), using
// buf (a multiple of 8 bytes past the header) as the ioctl's buffer. With sync, the
// file's dirty data is written back first. Without, btrfs reports data not yet written
// back as delalloc only where it fills a hole: over an existing extent, it reports that
// extent, whose data the write will replace.
func fileExtents(fd int, off, end int64, sync bool, buf []uint64) ([]extent, error) {
	var flags uint32
	if sync {
		flags = fiemapFlagSync
	}
	b := unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), len(buf)*8)
	max := uint32((len(b) - fiemapHeaderLen) / fiemapExtentLen)
	var out []extent
	for off < end {
		clear(b[:fiemapHeaderLen])
		binary.NativeEndian.PutUint64(b[0:], uint64(off))
		binary.NativeEndian.PutUint64(b[8:], uint64(end-off))
		binary.NativeEndian.PutUint32(b[16:], flags)
		binary.NativeEndian.PutUint32(b[24:], max)
		if err := ioctl(fd, fsIocFiemap, unsafe.Pointer(&buf[0])); err != nil {
			return nil, err
		}
		n := binary.NativeEndian.Uint32(b[20:])
		if n == 0 {
			break
		}
		last := false
		for i := range n {
			e := b[fiemapHeaderLen+int(i)*fiemapExtentLen:]
			x := extent{
				logical:  int64(binary.NativeEndian.Uint64(e[0:])),
				physical: int64(binary.NativeEndian.Uint64(e[8:])),
				length:   int64(binary.NativeEndian.Uint64(e[16:])),
				flags:    binary.NativeEndian.Uint32(e[40:]),
			}
			out = append(out, x)
			off = x.logical + x.length
			last = x.flags&fiemapExtentLast != 0
		}
		if last || n < max {
			break
		}
	}
	return out, nil
}

// clipExtents cuts es (sorted) at size.
func clipExtents(es []extent, size int64) []extent {
	for i := range es {
		if es[i].logical >= size {
			return es[:i]
		}
		if es[i].logical+es[i].length > size {
			es[i].length = size - es[i].logical
			return es[:i+1]
		}
	}
	return es
}

// extentAt returns the extent of es (sorted, disjoint) that covers x, or nil for a hole,
// and where that extent or hole ends. *i is where to start looking, and is advanced
// past the extents that end at or before x.
func extentAt(es []extent, i *int, x int64) (*extent, int64) {
	for *i < len(es) && es[*i].logical+es[*i].length <= x {
		*i++
	}
	switch {
	case *i == len(es):
		return nil, 1<<63 - 1
	case x < es[*i].logical:
		return nil, es[*i].logical
	}
	return &es[*i], es[*i].logical + es[*i].length
}

// sameData reports whether s and d (extents or holes) hold the same data from x on.
func sameData(s, d *extent, x int64) bool {
	switch {
	case s == nil || d == nil:
		return s == d // two holes read as zeros
	case (s.flags|d.flags)&fiemapExtentOpaque != 0:
		return false
	}
	return s.physical+(x-s.logical) == d.physical+(x-d.logical)
}

func alignUp(x, b int64) int64   { return (x + b - 1) / b * b }
func alignDown(x, b int64) int64 { return x / b * b }
