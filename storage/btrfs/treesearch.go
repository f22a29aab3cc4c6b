package btrfs

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// BTRFS_IOC_TREE_SEARCH_V2 and the items of a subvolume's tree that tree plans read
// (treeplan.go): inode items, names, extended attributes, directory entries and file
// extents.
//
// A search names a range of keys (objectid, type, offset), compared as one compound key,
// and a minimum transaction: the kernel then skips every node and leaf last written
// before that transaction, so a search of what changed since a transaction costs what
// changed, not the size of the tree. It returns every item of the leaves it visits that
// falls in the range, so the caller filters by type and by the item's own transaction.
// Items are in the filesystem's on-disk byte order, little-endian; the search's own
// header is in the machine's.

// Item types (BTRFS_*_KEY in the kernel's btrfs_tree.h).
const (
	keyInodeItem   = 1
	keyInodeRef    = 12
	keyInodeExtref = 13
	keyXattrItem   = 24
	keyDirIndex    = 96
	keyExtentData  = 108
	keyRootItem    = 132

	searchKeyLen    = 104 // struct btrfs_ioctl_search_key
	searchHeaderLen = 32  // struct btrfs_ioctl_search_header
	searchBufLen    = 256 << 10
	maxNodeSize     = 64 << 10 // BTRFS_MAX_METADATA_BLOCKSIZE: no item is larger
	inodeItemLen    = 160      // struct btrfs_inode_item
	dirItemLen      = 30       // struct btrfs_dir_item, before its name and data
	extentInlineOff = 21       // the data of an inline struct btrfs_file_extent_item
	extentItemLen   = 53       // a regular or preallocated struct btrfs_file_extent_item
)

// BTRFS_IOC_TREE_SEARCH_V2: struct btrfs_ioctl_search_args_v2 is the key and a u64
// buffer size, followed by the buffer.
var iocTreeSearchV2 = ioc(iocRead|iocWrite, 17, searchKeyLen+8)

// searchKey is a compound key of a btrfs tree.
type searchKey struct {
	objectid uint64
	typ      uint32
	offset   uint64
}

var (
	keyFirst = searchKey{0, 0, 0}
	keyLast  = searchKey{^uint64(0), 255, ^uint64(0)}
)

// next returns the key right after k.
func (k searchKey) next() (searchKey, bool) {
	switch {
	case k.offset < ^uint64(0):
		k.offset++
	case k.typ < 255:
		k.typ, k.offset = k.typ+1, 0
	case k.objectid < ^uint64(0):
		k.objectid, k.typ, k.offset = k.objectid+1, 0, 0
	default:
		return k, false
	}
	return k, true
}

func keyLess(a, b searchKey) bool {
	if a.objectid != b.objectid {
		return a.objectid < b.objectid
	}
	if a.typ != b.typ {
		return a.typ < b.typ
	}
	return a.offset < b.offset
}

// searcher runs tree searches on the subvolume of fd (the tree treeID, 0 for fd's own)
// with one buffer; it is used by one goroutine.
type searcher struct {
	fd     int
	treeID uint64
	buf    []byte
}

func newSearcher(fd int) *searcher {
	return &searcher{fd: fd, buf: searchBufs.Get().([]byte)}
}

// close gives the searcher's buffer back.
func (s *searcher) close() {
	if s.buf != nil {
		searchBufs.Put(s.buf)
		s.buf = nil
	}
}

// searchBufs recycles the searchers' buffers (a quarter MiB each, zeroed when made).
var searchBufs = sync.Pool{New: func() any { return make([]byte, searchKeyLen+8+searchBufLen) }}

// search calls fn with every item whose key is in [lo, hi] and whose leaf was written
// at or after the transaction minTransid (0: every leaf). data is valid only during the
// call.
func (s *searcher) search(lo, hi searchKey, minTransid uint64, fn func(k searchKey, data []byte) error) error {
	buf := s.buf
	ne := binary.NativeEndian
	for {
		clear(buf[:searchKeyLen+8])
		ne.PutUint64(buf[0:], s.treeID)
		ne.PutUint64(buf[8:], lo.objectid)
		ne.PutUint64(buf[16:], hi.objectid)
		ne.PutUint64(buf[24:], lo.offset)
		ne.PutUint64(buf[32:], hi.offset)
		ne.PutUint64(buf[40:], minTransid)
		ne.PutUint64(buf[48:], ^uint64(0))
		ne.PutUint32(buf[56:], lo.typ)
		ne.PutUint32(buf[60:], hi.typ)
		ne.PutUint32(buf[64:], ^uint32(0)) // nr_items: as many as fit
		ne.PutUint64(buf[searchKeyLen:], searchBufLen)
		if err := ioctl(s.fd, iocTreeSearchV2, unsafe.Pointer(&buf[0])); err != nil {
			return fmt.Errorf("BTRFS_IOC_TREE_SEARCH_V2: %w", err)
		}
		n := ne.Uint32(buf[64:])
		if n == 0 {
			return nil
		}
		items := buf[searchKeyLen+8:]
		used := 0
		var last searchKey
		for range n {
			if len(items) < searchHeaderLen {
				return fmt.Errorf("BTRFS_IOC_TREE_SEARCH_V2: item header beyond the buffer")
			}
			k := searchKey{objectid: ne.Uint64(items[8:]), offset: ne.Uint64(items[16:]), typ: ne.Uint32(items[24:])}
			l := int(ne.Uint32(items[28:]))
			if len(items) < searchHeaderLen+l {
				return fmt.Errorf("BTRFS_IOC_TREE_SEARCH_V2: item of %d bytes beyond the buffer", l)
			}
			if err := fn(k, items[searchHeaderLen:searchHeaderLen+l]); err != nil {
				return err
			}
			items = items[searchHeaderLen+l:]
			used += searchHeaderLen + l
			last = k
		}
		// The kernel stops at the end of the range or when the next item does not
		// fit; no item is larger than a tree block, so with room for one left, this
		// was the end.
		if searchBufLen-used >= searchHeaderLen+maxNodeSize {
			return nil
		}
		var ok bool
		if lo, ok = last.next(); !ok || keyLess(hi, lo) {
			return nil
		}
	}
}

// inodeItem is the part of struct btrfs_inode_item a plan compares.
type inodeItem struct {
	gen, transid, size, rdev uint64
	nlink, uid, gid, mode    uint32
	atime, mtime             unix.Timespec
}

func (it *inodeItem) typ() uint32 { return it.mode & unix.S_IFMT }
func (it *inodeItem) isDir() bool { return it.typ() == unix.S_IFDIR }

func parseInodeItem(d []byte) (inodeItem, error) {
	if len(d) < inodeItemLen {
		return inodeItem{}, fmt.Errorf("inode item of %d bytes, want %d", len(d), inodeItemLen)
	}
	le := binary.LittleEndian
	ts := func(o int) unix.Timespec { // struct btrfs_timespec: u64 seconds, u32 nanoseconds
		return unix.Timespec{Sec: int64(le.Uint64(d[o:])), Nsec: int64(le.Uint32(d[o+8:]))}
	}
	return inodeItem{
		gen: le.Uint64(d[0:]), transid: le.Uint64(d[8:]), size: le.Uint64(d[16:]),
		nlink: le.Uint32(d[40:]), uid: le.Uint32(d[44:]), gid: le.Uint32(d[48:]), mode: le.Uint32(d[52:]),
		rdev: le.Uint64(d[56:]), atime: ts(112), mtime: ts(136),
	}, nil
}

// inodeRef is one name of an inode: the entry name of the directory parent.
type inodeRef struct {
	parent uint64
	name   string
}

// dirEntry is what a directory entry names: an inode of the same tree, or the root of
// a nested subvolume (whose ino is then the subvolume's id).
type dirEntry struct {
	ino    uint64
	subvol bool
}

// fileExtent is an EXTENT_DATA item: the data of a file from offset off.
type fileExtent struct {
	off      uint64
	typ      uint8 // 0 inline, 1 regular, 2 preallocated
	compress uint8
	ramBytes uint64
	// regular and preallocated: the extent on disk (bytenr 0: a hole), the offset of
	// the file's data in it and the data's length
	bytenr, diskLen, extOff, length uint64
	inline                          string
}

const (
	extentInline   = 0
	extentRegular  = 1
	extentPrealloc = 2
)

// end is where the item's data ends in the file.
func (e *fileExtent) end() uint64 {
	if e.typ == extentInline {
		return e.off + e.ramBytes
	}
	return e.off + e.length
}

// inodeState is everything of one inode of a tree that a plan compares.
type inodeState struct {
	ino     uint64
	item    inodeItem
	refs    []inodeRef
	xattrs  map[string]string
	entries map[string]dirEntry // a directory's (DIR_INDEX items)
	extents []fileExtent        // a regular file's, by offset
}

// loadInode reads the inode ino of s's tree, or returns nil if the tree has none.
func (s *searcher) loadInode(ino uint64) (*inodeState, error) {
	var r *inodeState
	err := s.loadInodes([]uint64{ino}, 0, func(_ uint64, st *inodeState) { r = st })
	return r, err
}

// loadInodes reads the inodes inos of s's tree (sorted, distinct) and calls fn with
// each, nil for one the tree does not have. A search costs ~8 µs here, more than
// reading a few small inodes' items, so inodes whose numbers are at most gap apart are
// read by one search, and the items of the inodes between them dropped.
func (s *searcher) loadInodes(inos []uint64, gap uint64, fn func(ino uint64, st *inodeState)) error {
	for i := 0; i < len(inos); {
		j := i + 1
		for j < len(inos) && inos[j]-inos[j-1] <= gap {
			j++
		}
		group := inos[i:j]
		states := make(map[uint64]*inodeState, len(group))
		err := s.search(searchKey{group[0], keyInodeItem, 0}, searchKey{group[len(group)-1], keyExtentData, ^uint64(0)}, 0, func(k searchKey, d []byte) error {
			if k.typ < keyInodeItem || k.typ > keyExtentData {
				return nil
			}
			if _, ok := slices.BinarySearch(group, k.objectid); !ok {
				return nil
			}
			x := states[k.objectid]
			if x == nil {
				x = &inodeState{ino: k.objectid}
				states[k.objectid] = x
			}
			return x.addItem(k, d)
		})
		if err != nil {
			return err
		}
		for _, ino := range group {
			x := states[ino]
			if x != nil && x.item.gen == 0 && x.item.mode == 0 {
				return fmt.Errorf("inode %d has items but no inode item", ino)
			}
			fn(ino, x)
		}
		i = j
	}
	return nil
}

// addItem adds the item k of the inode to x.
func (x *inodeState) addItem(k searchKey, d []byte) error {
	le := binary.LittleEndian
	switch k.typ {
	case keyInodeItem:
		it, err := parseInodeItem(d)
		if err != nil {
			return fmt.Errorf("inode %d: %w", x.ino, err)
		}
		x.item = it
	case keyInodeRef: // the parent is the key's offset: {u64 index, u16 len, name}...
		for len(d) > 0 {
			if len(d) < 10 || len(d) < 10+int(le.Uint16(d[8:])) {
				return fmt.Errorf("inode %d: inode ref beyond its item", x.ino)
			}
			n := int(le.Uint16(d[8:]))
			x.refs = append(x.refs, inodeRef{k.offset, string(d[10 : 10+n])})
			d = d[10+n:]
		}
	case keyInodeExtref: // {u64 parent, u64 index, u16 len, name}...
		for len(d) > 0 {
			if len(d) < 18 || len(d) < 18+int(le.Uint16(d[16:])) {
				return fmt.Errorf("inode %d: inode extref beyond its item", x.ino)
			}
			n := int(le.Uint16(d[16:]))
			x.refs = append(x.refs, inodeRef{le.Uint64(d), string(d[18 : 18+n])})
			d = d[18+n:]
		}
	case keyXattrItem:
		return forDirItems(d, func(_ dirEntry, name, data []byte) {
			if x.xattrs == nil {
				x.xattrs = map[string]string{}
			}
			x.xattrs[string(name)] = string(data)
		})
	case keyDirIndex:
		return forDirItems(d, func(e dirEntry, name, _ []byte) {
			if x.entries == nil {
				x.entries = map[string]dirEntry{}
			}
			x.entries[string(name)] = e
		})
	case keyExtentData:
		e, err := parseFileExtent(k.offset, d)
		if err != nil {
			return fmt.Errorf("inode %d: %w", x.ino, err)
		}
		x.extents = append(x.extents, e)
	}
	return nil
}

// forDirItems calls fn for each struct btrfs_dir_item packed in d (an XATTR_ITEM or a
// directory entry): {key location, u64 transid, u16 data_len, u16 name_len, u8 type},
// then the name and the data.
func forDirItems(d []byte, fn func(e dirEntry, name, data []byte)) error {
	le := binary.LittleEndian
	for len(d) > 0 {
		if len(d) < dirItemLen {
			return fmt.Errorf("directory item of %d bytes, want at least %d", len(d), dirItemLen)
		}
		dl, nl := int(le.Uint16(d[25:])), int(le.Uint16(d[27:]))
		if len(d) < dirItemLen+nl+dl {
			return fmt.Errorf("directory item: name and data beyond the item")
		}
		e := dirEntry{ino: le.Uint64(d[0:]), subvol: d[8] == keyRootItem}
		fn(e, d[dirItemLen:dirItemLen+nl], d[dirItemLen+nl:dirItemLen+nl+dl])
		d = d[dirItemLen+nl+dl:]
	}
	return nil
}

// parseFileExtent decodes struct btrfs_file_extent_item: {u64 generation, u64 ram_bytes,
// u8 compression, u8 encryption, u16 other_encoding, u8 type}, then the inline data or
// {u64 disk_bytenr, disk_num_bytes, offset, num_bytes}.
func parseFileExtent(off uint64, d []byte) (fileExtent, error) {
	if len(d) < extentInlineOff {
		return fileExtent{}, fmt.Errorf("file extent at %d: item of %d bytes", off, len(d))
	}
	le := binary.LittleEndian
	e := fileExtent{off: off, ramBytes: le.Uint64(d[8:]), compress: d[16], typ: d[20]}
	if d[17] != 0 || le.Uint16(d[18:]) != 0 {
		return e, fmt.Errorf("file extent at %d: encrypted or encoded (%d, %d)", off, d[17], le.Uint16(d[18:]))
	}
	switch e.typ {
	case extentInline:
		e.inline = string(d[extentInlineOff:])
	case extentRegular, extentPrealloc:
		if len(d) < extentItemLen {
			return e, fmt.Errorf("file extent at %d: item of %d bytes, want %d", off, len(d), extentItemLen)
		}
		e.bytenr, e.diskLen, e.extOff, e.length = le.Uint64(d[21:]), le.Uint64(d[29:]), le.Uint64(d[37:]), le.Uint64(d[45:])
	default:
		return e, fmt.Errorf("file extent at %d: unknown type %d", off, e.typ)
	}
	return e, nil
}

// newEncodeDev turns the kernel's internal device number (major << 20 | minor), which
// an inode item holds, into user space's (and the send stream's) encoding.
func newEncodeDev(d uint64) uint64 {
	major, minor := d>>20, d&0xfffff
	return minor&0xff | major<<8 | (minor&^0xff)<<12
}
