package engine

import (
	"os"
	"path/filepath"
	"testing"
)

// TestJoinDataDir: the first engine of a data directory is alone; one that opens while
// it lives is not (another engine's resident checkpoints are not its to recover); once
// every engine has closed, the next is alone again.
func TestJoinDataDir(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "locks"), 0o700); err != nil {
		t.Fatal(err)
	}
	join := func(want bool, what string) *os.File {
		t.Helper()
		f, alone, err := joinDataDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if alone != want {
			t.Fatalf("%s: alone = %v, want %v", what, alone, want)
		}
		return f
	}
	first := join(true, "first engine")
	second := join(false, "second engine, the first alive")
	first.Close()
	third := join(false, "third engine, the second alive")
	second.Close()
	third.Close()
	join(true, "an engine after all closed").Close()
}
