package main

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"testing"
)

// The captured sessions in testdata are what pgx's stdlib driver and go-sql-driver
// sent to PostgreSQL 15 and MariaDB 10.11 for: Ping, twice a query with one argument,
// BEGIN, SELECT 1, COMMIT, Close.
//
// PostgreSQL: the start-up packet, "-- ping" twice (Q), Parse+Describe+Sync,
// Bind+Execute+Sync twice, begin/SELECT 1/commit (Q), Terminate: 8 round trips.
// MySQL: the handshake response (sequence id 1), COM_PING, twice COM_STMT_PREPARE +
// COM_STMT_EXECUTE + COM_STMT_CLOSE, three COM_QUERY, COM_QUIT: 8 round trips and 3
// commands without a reply.
func TestCapturedSessions(t *testing.T) {
	for _, tc := range []struct {
		file           string
		newParser      func() parser
		trips, oneways int
	}{
		{"testdata/pg_session.bin", func() parser { return &pgParser{} }, 8, 0},
		{"testdata/my_session.bin", func() parser { return &myParser{} }, 8, 3},
	} {
		b, err := os.ReadFile(tc.file)
		if err != nil {
			t.Fatal(err)
		}
		for _, split := range []string{"whole", "bytes", "random"} {
			tr, ow := feedSplit(tc.newParser(), b, split)
			if tr != tc.trips || ow != tc.oneways {
				t.Errorf("%s fed %s: %d round trips, %d one-way; want %d, %d", tc.file, split, tr, ow, tc.trips, tc.oneways)
			}
		}
	}
}

// feedSplit feeds b whole, one byte at a time, or in random chunks.
func feedSplit(p parser, b []byte, how string) (trips, oneway int) {
	add := func(chunk []byte) {
		t, o := p.feed(chunk)
		trips, oneway = trips+t, oneway+o
	}
	switch how {
	case "whole":
		add(b)
	case "bytes":
		for i := range b {
			add(b[i : i+1])
		}
	default:
		r := rand.New(rand.NewPCG(1, 2))
		for len(b) > 0 {
			n := min(len(b), 1+r.IntN(20))
			add(b[:n])
			b = b[n:]
		}
	}
	return trips, oneway
}

func pgMsg(typ byte, body []byte) []byte {
	m := []byte{typ, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(m[1:], uint32(4+len(body)))
	return append(m, body...)
}

func pgUntyped(code uint32, body []byte) []byte {
	m := make([]byte, 8)
	binary.BigEndian.PutUint32(m, uint32(8+len(body)))
	binary.BigEndian.PutUint32(m[4:], code)
	return append(m, body...)
}

// An SSLRequest the server declines is followed by the real start-up packet; bodies
// that contain 'Q' and 'S' bytes are skipped; only Q and S count.
func TestPostgresParser(t *testing.T) {
	var s []byte
	s = append(s, pgUntyped(pgSSLRequest, nil)...)
	s = append(s, pgUntyped(196608, []byte("user\x00QQQ\x00S\x00\x00"))...)
	s = append(s, pgMsg('p', []byte("QS password"))...)
	s = append(s, pgMsg('Q', []byte("SELECT 'S'\x00"))...)
	s = append(s, pgMsg('P', bytes.Repeat([]byte("S"), 300))...)
	s = append(s, pgMsg('H', nil)...) // Flush: no round trip of its own
	s = append(s, pgMsg('S', nil)...)
	s = append(s, pgMsg('X', nil)...)
	for _, how := range []string{"whole", "bytes", "random"} {
		if tr, _ := feedSplit(&pgParser{}, s, how); tr != 2 {
			t.Errorf("fed %s: %d round trips, want 2", how, tr)
		}
	}
	// A cancel request is a connection of its own: one untyped packet.
	if tr, _ := feedSplit(&pgParser{}, pgUntyped(80877102, make([]byte, 8)), "whole"); tr != 0 {
		t.Errorf("cancel request: %d round trips, want 0", tr)
	}
}

func myPacket(seq byte, payload []byte) []byte {
	n := len(payload)
	return append([]byte{byte(n), byte(n >> 8), byte(n >> 16), seq}, payload...)
}

// A payload of 16 MiB or more is split into packets whose continuations have
// sequence ids from 1; an empty continuation packet ends a payload of exactly
// 0xffffff bytes. Authentication packets have sequence ids from 1 too.
func TestMySQLParser(t *testing.T) {
	var s []byte
	s = append(s, myPacket(1, bytes.Repeat([]byte{0}, 100))...) // handshake response
	s = append(s, myPacket(3, []byte("auth switch response"))...)
	big := append([]byte{0x03}, bytes.Repeat([]byte("x"), 0xffffff-1)...)
	s = append(s, myPacket(0, big)...)
	s = append(s, myPacket(1, nil)...)                      // its empty continuation
	s = append(s, myPacket(0, []byte{0x19, 1, 0, 0, 0})...) // COM_STMT_CLOSE
	s = append(s, myPacket(0, []byte{0x0e})...)             // COM_PING
	s = append(s, myPacket(0, []byte{0x03, 0, 0, 0, 0})...) // COM_QUERY whose text starts with zeros
	s = append(s, myPacket(0, []byte{0x01})...)             // COM_QUIT
	for _, how := range []string{"whole", "random"} {
		if tr, ow := feedSplit(&myParser{}, s, how); tr != 3 || ow != 2 {
			t.Errorf("fed %s: %d round trips, %d one-way; want 3, 2", how, tr, ow)
		}
	}
}
