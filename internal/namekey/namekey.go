// Package namekey maps lock names to fixed-size keys. Names are compared byte for
// byte; keys come from SHA-256, so two different names get the same key only with
// negligible probability, and no name is ever truncated into another.
package namekey

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
)

// Key returns the 32-byte SHA-256 of name: the unique key of row-based strategies.
func Key(name string) []byte {
	k := sha256.Sum256([]byte(name))
	return k[:]
}

// Int64 returns a 64-bit key for name in a namespace: the first 8 bytes of
// SHA-256(namespace, 0, name), as a signed integer.
func Int64(namespace, name string) int64 {
	h := sha256.New()
	h.Write([]byte(namespace))
	h.Write([]byte{0})
	h.Write([]byte(name))
	var sum [sha256.Size]byte
	return int64(binary.BigEndian.Uint64(h.Sum(sum[:0])))
}

// Hex returns n hex characters of SHA-256(namespace, 0, name).
func Hex(namespace, name string, n int) string {
	h := sha256.New()
	h.Write([]byte(namespace))
	h.Write([]byte{0})
	h.Write([]byte(name))
	s := hex.EncodeToString(h.Sum(nil))
	if n < len(s) {
		s = s[:n]
	}
	return s
}

// MySQLHex is b as a MySQL hex literal, X'...': a key written into a statement's
// text (go-sql-driver prepares, runs and closes a statement with parameters; one
// without is a single round trip, and hex digits cannot inject anything).
func MySQLHex(b []byte) string { return "X'" + hex.EncodeToString(b) + "'" }
