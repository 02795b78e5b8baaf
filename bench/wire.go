package main

// Wire counting. Every client's pool dials through countingDialer, which wraps the
// TCP connection so that each Write is parsed as part of the client-to-server byte
// stream before it is sent. A round trip is counted when the client sends what makes
// the server answer: on PostgreSQL a simple Query ('Q') or an extended-protocol Sync
// ('S'); on MySQL a packet with sequence id 0 (the first packet of a command), except
// the commands that get no reply (COM_QUIT, COM_STMT_CLOSE, COM_STMT_SEND_LONG_DATA),
// which are counted apart as one-way. Start-up and handshake packets are skipped.
//
// The wrapper sits in the writing goroutine itself: no extra goroutine, copy or hop,
// so counting adds a few nanoseconds per Write and no latency. The connection must be
// plain TCP (TLS is turned off by openClient): over TLS the bytes are ciphertext.

import (
	"context"
	"encoding/binary"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// wireCount accumulates what the connections of one client sent.
type wireCount struct {
	trips  atomic.Int64 // round trips: statements, Syncs, commands with a reply
	oneway atomic.Int64 // commands without a reply (MySQL COM_STMT_CLOSE, COM_QUIT)
}

// parser consumes a client-to-server byte stream in arbitrary chunks.
type parser interface {
	// feed parses b, which follows the bytes of earlier calls, and returns the round
	// trips and one-way commands that start in it.
	feed(b []byte) (trips, oneway int)
}

// PostgreSQL protocol codes sent in place of a startup packet's protocol version.
const (
	pgSSLRequest    = 80877103
	pgGSSENCRequest = 80877104
)

// pgParser parses PostgreSQL frontend messages: after the untyped start-up packet
// (length, protocol code, body), each message is a type byte and a length that
// counts itself but not the type byte.
type pgParser struct {
	started bool // the start-up packet was passed: messages now have a type byte
	broken  bool // a length made no sense: stop counting rather than guess
	hdr     [8]byte
	nhdr    int
	skip    int // bytes of the current message's body still to pass
}

func (p *pgParser) feed(b []byte) (trips, oneway int) {
	for len(b) > 0 && !p.broken {
		if p.skip > 0 {
			n := min(p.skip, len(b))
			p.skip, b = p.skip-n, b[n:]
			continue
		}
		hl := 5
		if !p.started {
			hl = 8
		}
		n := copy(p.hdr[p.nhdr:hl], b)
		p.nhdr, b = p.nhdr+n, b[n:]
		if p.nhdr < hl {
			break
		}
		p.nhdr = 0
		if !p.started {
			l := int(binary.BigEndian.Uint32(p.hdr[0:4]))
			code := binary.BigEndian.Uint32(p.hdr[4:8])
			p.skip, p.broken = l-8, l < 8
			// An SSL or GSS encryption request is followed by a real start-up packet
			// (when the server declines).
			p.started = code != pgSSLRequest && code != pgGSSENCRequest
			continue
		}
		l := int(binary.BigEndian.Uint32(p.hdr[1:5]))
		p.skip, p.broken = l-4, l < 4
		if t := p.hdr[0]; t == 'Q' || t == 'S' {
			trips++
		}
	}
	return trips, oneway
}

// MySQL commands that the server does not answer.
const (
	comQuit         = 0x01
	comStmtSendLong = 0x18
	comStmtClose    = 0x19
)

// myParser parses MySQL client packets: a 3-byte little-endian payload length, a
// sequence id, the payload. A command starts with sequence id 0 and its first payload
// byte is the command code. The handshake response and authentication packets have
// sequence ids from 1, as do the continuations of payloads of 16 MiB or more.
type myParser struct {
	hdr  [5]byte
	nhdr int
	skip int
}

func (p *myParser) feed(b []byte) (trips, oneway int) {
	for len(b) > 0 {
		if p.skip > 0 {
			n := min(p.skip, len(b))
			p.skip, b = p.skip-n, b[n:]
			continue
		}
		// The header, plus the command byte when the packet starts a command.
		hl := 4
		if p.nhdr >= 4 && p.hdr[3] == 0 && p.payloadLen() > 0 {
			hl = 5
		}
		n := copy(p.hdr[p.nhdr:hl], b)
		p.nhdr, b = p.nhdr+n, b[n:]
		if p.nhdr < hl {
			break
		}
		if hl == 4 && p.hdr[3] == 0 && p.payloadLen() > 0 {
			continue // read the command byte next
		}
		p.nhdr = 0
		p.skip = p.payloadLen() - (hl - 4)
		if p.hdr[3] != 0 {
			continue
		}
		switch p.hdr[4] {
		case comQuit, comStmtClose, comStmtSendLong:
			oneway++
		default:
			trips++
		}
	}
	return trips, oneway
}

func (p *myParser) payloadLen() int {
	return int(p.hdr[0]) | int(p.hdr[1])<<8 | int(p.hdr[2])<<16
}

// countingConn is a net.Conn whose writes are parsed and counted.
type countingConn struct {
	net.Conn
	mu sync.Mutex // drivers write from one goroutine at a time; this is a guard
	p  parser
	c  *wireCount
}

func (c *countingConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	t, o := c.p.feed(b)
	c.mu.Unlock()
	if t != 0 {
		c.c.trips.Add(int64(t))
	}
	if o != 0 {
		c.c.oneway.Add(int64(o))
	}
	return c.Conn.Write(b)
}

// countingDialer returns a dial function whose connections count into c, parsed
// with a new parser from newParser each.
func countingDialer(c *wireCount, newParser func() parser) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: conn, p: newParser(), c: c}, nil
	}
}
