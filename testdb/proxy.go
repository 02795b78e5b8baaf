package testdb

import (
	"database/sql"
	"errors"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
)

// Proxy is a TCP proxy in front of a database server that tests use to cause network
// faults between one client and the server:
//
//   - Partition: nothing passes in either direction and nothing is closed (no FIN, no
//     RST): both ends see silence, as when a cable is pulled or a firewall drops
//     packets. New connections are accepted but get no answer. Heal lets the held
//     bytes through again (as TCP retransmission does after a short partition), and a
//     connection whose other end closed meanwhile is reset.
//   - PauseReplies: the server's replies are held while the client's requests still
//     reach it: a statement runs and commits, and its reply is lost until Heal.
//   - SetLatency: every chunk of bytes is delayed by the given time, each way.
//
// The server sees the proxy as its client: a server-side idle timeout still ends a
// partitioned session, but TCP keepalives are answered by the proxy's kernel.
type Proxy struct {
	ln     net.Listener
	target string

	mu        sync.Mutex
	cond      *sync.Cond
	cut       [2]bool // [toServer, toClient]: bytes in that direction are held
	latency   time.Duration
	conns     map[*proxyConn]struct{}
	closed    bool
	wg        sync.WaitGroup
	connected int
}

type proxyConn struct {
	client net.Conn
	mu     sync.Mutex
	server net.Conn // set once dialled
}

// StartProxy starts a proxy to target (host:port), stopped when the test ends.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testdb: proxy: %v", err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[*proxyConn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr returns the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Connections returns how many client connections the proxy accepted so far.
func (p *Proxy) Connections() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.connected
}

// Partition holds every byte in both directions, on open and new connections.
func (p *Proxy) Partition() { p.set(true, true) }

// PauseReplies holds the bytes from the server to the client only.
func (p *Proxy) PauseReplies() { p.set(false, true) }

// Heal lets bytes pass again in both directions.
func (p *Proxy) Heal() { p.set(false, false) }

func (p *Proxy) set(toServer, toClient bool) {
	p.mu.Lock()
	p.cut = [2]bool{toServer, toClient}
	p.cond.Broadcast()
	p.mu.Unlock()
}

// SetLatency delays every chunk by d in each direction (0: none).
func (p *Proxy) SetLatency(d time.Duration) {
	p.mu.Lock()
	p.latency = d
	p.mu.Unlock()
}

// Close stops the proxy and resets every connection through it.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.cond.Broadcast()
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	p.ln.Close()
	for c := range conns {
		c.reset()
	}
	p.wg.Wait()
}

func (c *proxyConn) reset() {
	c.mu.Lock()
	server := c.server
	c.mu.Unlock()
	for _, nc := range []net.Conn{c.client, server} {
		if nc == nil {
			continue
		}
		if tc, ok := nc.(*net.TCPConn); ok {
			tc.SetLinger(0) // RST, not FIN
		}
		nc.Close()
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			client.Close()
			return
		}
		c := &proxyConn{client: client}
		p.conns[c] = struct{}{}
		p.connected++
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(c)
	}
}

// wait blocks while direction dir is cut; it reports false once the proxy is closed.
func (p *Proxy) wait(dir int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.cut[dir] && !p.closed {
		p.cond.Wait()
	}
	return !p.closed
}

func (p *Proxy) serve(c *proxyConn) {
	defer p.wg.Done()
	// A partitioned network does not connect: wait for Heal before dialling.
	p.mu.Lock()
	held := p.cut[0]
	p.mu.Unlock()
	if !p.wait(0) {
		c.reset()
		return
	}
	var sent []byte
	if held {
		// A client that gave up meanwhile is not connected: the server would start a
		// session for nothing, and a heal that lets dozens of those through at once
		// is a load no real partition makes (its connection attempts never reached
		// the server).
		var alive bool
		if sent, alive = clientAlive(c.client); !alive {
			c.reset()
			return
		}
	}
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		c.reset()
		return
	}
	if len(sent) > 0 {
		if _, err := server.Write(sent); err != nil {
			server.Close()
			c.reset()
			return
		}
	}
	c.mu.Lock()
	c.server = server
	c.mu.Unlock()
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		c.reset()
		return
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pipe(c, c.client, server, 0) }()
	go func() { defer wg.Done(); p.pipe(c, server, c.client, 1) }()
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// clientAlive reads what client sent so far, until it has been silent for a moment,
// and reports whether it is still connected (no end of stream or error). The bytes
// read are returned, to be sent on.
func clientAlive(client net.Conn) ([]byte, bool) {
	var sent []byte
	buf := make([]byte, 32<<10)
	for {
		client.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
		n, err := client.Read(buf)
		sent = append(sent, buf[:n]...)
		if err != nil {
			client.SetReadDeadline(time.Time{})
			var ne net.Error
			return sent, errors.As(err, &ne) && ne.Timeout()
		}
	}
}

type chunk struct {
	b  []byte
	at time.Time
}

// pipe copies src to dst in direction dir, holding bytes while the direction is cut
// and delaying them by the latency. When src ends (EOF or error), the whole
// connection is reset once the direction is open again.
func (p *Proxy) pipe(c *proxyConn, src, dst net.Conn, dir int) {
	q := make(chan chunk, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ch := range q {
			if d := time.Until(ch.at); d > 0 {
				time.Sleep(d)
			}
			if !p.wait(dir) {
				return
			}
			if _, err := dst.Write(ch.b); err != nil {
				c.reset()
				return
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			lat := p.latency
			p.mu.Unlock()
			b := make([]byte, n)
			copy(b, buf[:n])
			q <- chunk{b: b, at: time.Now().Add(lat)}
		}
		if err != nil {
			close(q)
			<-done
			// The other end went away: this side learns it (a reset) when the network
			// lets it through.
			p.wait(dir)
			c.reset()
			return
		}
	}
}

// serverAddr returns the host:port of the server behind dsn.
func serverAddr(d sqllock.Dialect, dsn string) (string, error) {
	if d == sqllock.Postgres {
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			return "", err
		}
		return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), nil
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", err
	}
	return cfg.Addr, nil
}

// OpenProxied returns a new pool to the migrated database of d whose connections all
// go through a new Proxy, and the Proxy. Both end with the test.
func OpenProxied(t testing.TB, d sqllock.Dialect) (*sql.DB, *Proxy) {
	t.Helper()
	p := StartProxyTo(t, d)
	db, err := OpenVia(d, DSN(t, d), p.Addr())
	if err != nil {
		t.Fatalf("testdb: open %v through a proxy: %v", d, err)
	}
	t.Cleanup(func() {
		p.Close() // first: connections stuck in a partition return at once
		db.Close()
	})
	return db, p
}

// StartProxyTo starts a Proxy to the migrated server of d, stopped when the test
// ends. With OpenVia, a child process of the test opens its pool through it.
func StartProxyTo(t testing.TB, d sqllock.Dialect) *Proxy {
	t.Helper()
	addr, err := serverAddr(d, DSN(t, d))
	if err != nil {
		t.Fatalf("testdb: server address of %v: %v", d, err)
	}
	return StartProxy(t, addr)
}

// OpenVia opens a pool to the server of dsn whose connections go to addr instead (a
// Proxy's Addr), with a 5 s connect timeout. A child process of a test, which has no
// testing.TB of the parent's, uses it with the parent's DSN and Proxy.
func OpenVia(d sqllock.Dialect, dsn, addr string) (*sql.DB, error) { return openVia(d, dsn, addr) }

// openVia opens dsn with its server address replaced by addr.
func openVia(d sqllock.Dialect, dsn, addr string) (*sql.DB, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if d == sqllock.Postgres {
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			return nil, err
		}
		pn, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return nil, err
		}
		cfg.Host, cfg.Port = host, uint16(pn)
		cfg.Fallbacks = nil
		cfg.ConnectTimeout = 5 * time.Second
		return stdlib.OpenDB(*cfg), nil
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, err
	}
	cfg.Addr = addr
	cfg.Timeout = 5 * time.Second
	return sql.Open("mysql", cfg.FormatDSN())
}
