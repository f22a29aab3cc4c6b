package engine

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/internal/initctl"
)

type entry struct {
	mode     fs.FileMode
	uid, gid uint32
	size     int64
	mtime    int64
	ino      uint64
	link     string
}

// scan records every path under root (relative, "/"-rooted), skipping the control dir.
func scan(ctx context.Context, root string) (map[string]entry, error) {
	out := map[string]entry{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		if rel == initctl.Dir {
			return filepath.SkipDir
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		st := fi.Sys().(*syscall.Stat_t)
		en := entry{mode: fi.Mode(), uid: st.Uid, gid: st.Gid, size: fi.Size(), mtime: st.Mtim.Nano(), ino: st.Ino}
		if fi.Mode()&fs.ModeSymlink != 0 {
			en.link, _ = os.Readlink(p)
		}
		out["/"+rel] = en
		return nil
	})
	return out, err
}

func diffTrees(ctx context.Context, a, b string) ([]model.Change, error) {
	ea, err := scan(ctx, a)
	if err != nil {
		return nil, err
	}
	eb, err := scan(ctx, b)
	if err != nil {
		return nil, err
	}
	var out []model.Change
	for p, x := range ea {
		y, ok := eb[p]
		switch {
		case !ok:
			out = append(out, model.Change{Kind: "deleted", Path: p})
		case x.mode != y.mode || x.uid != y.uid || x.gid != y.gid || x.link != y.link || x.size != y.size:
			out = append(out, model.Change{Kind: "changed", Path: p})
		case x.mode.IsRegular() && x.mtime != y.mtime && !sameContent(filepath.Join(a, p), filepath.Join(b, p)):
			out = append(out, model.Change{Kind: "changed", Path: p})
		}
	}
	for p := range eb {
		if _, ok := ea[p]; !ok {
			out = append(out, model.Change{Kind: "added", Path: p})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

func sameContent(a, b string) bool {
	fa, err := os.Open(a)
	if err != nil {
		return false
	}
	defer fa.Close()
	fb, err := os.Open(b)
	if err != nil {
		return false
	}
	defer fb.Close()
	ba, bb := make([]byte, 64<<10), make([]byte, 64<<10)
	for {
		na, ea := io.ReadFull(fa, ba)
		nb, eb := io.ReadFull(fb, bb)
		if na != nb || !bytes.Equal(ba[:na], bb[:nb]) {
			return false
		}
		if ea != nil || eb != nil {
			return ea == eb || (ea == io.ErrUnexpectedEOF && eb == io.ErrUnexpectedEOF)
		}
	}
}
