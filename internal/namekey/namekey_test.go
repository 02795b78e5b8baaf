package namekey

import (
	"encoding/hex"
	"testing"
)

func TestKeyIsSHA256(t *testing.T) {
	// SHA-256("abc"), FIPS 180-2 test vector.
	want := "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
	if got := hex.EncodeToString(Key("abc")); got != want {
		t.Fatalf("Key(abc) = %s", got)
	}
}

func TestDistinctNames(t *testing.T) {
	names := []string{"Job", "job", "a", "a ", "a\x00", "a\x00b", "lock-8327", "lock-68168"}
	seenKey, seenInt, seenHex := map[string]bool{}, map[int64]bool{}, map[string]bool{}
	for _, n := range names {
		k, i, h := string(Key(n)), Int64("ns", n), Hex("ns", n, 56)
		if seenKey[k] || seenInt[i] || seenHex[h] {
			t.Fatalf("%q collides", n)
		}
		seenKey[k], seenInt[i], seenHex[h] = true, true, true
		if len(h) != 56 {
			t.Fatalf("Hex length %d", len(h))
		}
	}
	// The namespace separates, and the separator keeps ("a","bc") apart from ("ab","c").
	if Int64("ns1", "x") == Int64("ns2", "x") || Int64("a", "bc") == Int64("ab", "c") {
		t.Fatal("namespaces do not separate keys")
	}
}
