package cluster

import (
	"bytes"
	"log"
	"sync"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// logBridge turns memberlist's "[LEVEL] memberlist: text" log lines into zap
// entries. memberlist's [ERR] lines are network faults the protocol recovers
// from (failed pings to a dying member), so they become Warn, per STYLE 8.
// After close, lines are dropped: memberlist goroutines and timers can
// outlive Shutdown by a moment, and a test logger must not see them.
type logBridge struct {
	mu     sync.RWMutex // guards closed against in-flight writes
	closed bool
	log    *zap.Logger
}

func newLogBridge(l *zap.Logger) *logBridge { return &logBridge{log: l} }

func (b *logBridge) stdLogger() *log.Logger { return log.New(b, "", 0) }

// Write implements io.Writer; log.Logger calls it once per line.
func (b *logBridge) Write(p []byte) (int, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.closed {
		return len(p), nil
	}
	lvl, msg := parseMemberlistLine(p)
	if ce := b.log.Check(lvl, msg); ce != nil {
		ce.Write()
	}
	return len(p), nil
}

func (b *logBridge) close() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
}

// parseMemberlistLine splits "[WARN] memberlist: text\n" into a level and
// "text". Lines without a known prefix are Info, kept whole.
func parseMemberlistLine(p []byte) (zapcore.Level, string) {
	p = bytes.TrimRight(p, "\r\n")
	lvl := zapcore.InfoLevel
	if len(p) > 0 && p[0] == '[' {
		if end := bytes.IndexByte(p, ']'); end > 0 {
			switch string(p[1:end]) {
			case "DEBUG", "TRACE":
				lvl = zapcore.DebugLevel
			case "INFO":
				lvl = zapcore.InfoLevel
			case "WARN", "ERR", "ERROR":
				lvl = zapcore.WarnLevel
			}
			p = bytes.TrimLeft(p[end+1:], " ")
		}
	}
	p = bytes.TrimPrefix(p, []byte("memberlist: "))
	return lvl, string(p)
}
