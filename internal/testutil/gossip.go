package testutil

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"net"
	"testing"
)

// SendForgedDeath sends what an attacker holding the gossip key can send:
// one memberlist "dead" message for member node (its memberlist name,
// kvtier's Name@Incarnation), as if from member from, encrypted with key
// (AES-GCM, memberlist's encryption version 1, no label) in one UDP packet
// to the gossip address addr. memberlist v0.7.0 accepts it from any source
// address; inc must not be below the memberlist incarnation the receiver
// holds for node (a large value always passes). When from equals node the
// receiver records a leave instead of a death.
//
// memberlist has no API to declare another member dead; this writes the
// packet itself: message type 5 (deadMsg) followed by the msgpack map
// {Incarnation, Node, From} of memberlist's dead struct.
func SendForgedDeath(tb testing.TB, key []byte, addr, node, from string, inc uint32) {
	tb.Helper()
	msg := []byte{5, 0x83} // deadMsg; a map of three entries
	msg = msgpackStr(msg, "Incarnation")
	msg = append(msg, 0xce)
	msg = binary.BigEndian.AppendUint32(msg, inc)
	msg = msgpackStr(msg, "Node")
	msg = msgpackStr(msg, node)
	msg = msgpackStr(msg, "From")
	msg = msgpackStr(msg, from)

	block, err := aes.NewCipher(key)
	if err != nil {
		tb.Fatalf("forged death: gossip key: %v", err)
	}
	gcm, err := cipher.NewGCM(block)
	if err != nil {
		tb.Fatal(err)
	}
	pkt := make([]byte, 1+gcm.NonceSize(), 1+gcm.NonceSize()+len(msg)+gcm.Overhead())
	pkt[0] = 1 // encryption version 1: no padding
	if _, err := rand.Read(pkt[1:]); err != nil {
		tb.Fatal(err)
	}
	pkt = gcm.Seal(pkt, pkt[1:1+gcm.NonceSize()], msg, nil)

	conn, err := net.Dial("udp", addr)
	if err != nil {
		tb.Fatalf("forged death: dial %s: %v", addr, err)
	}
	defer conn.Close()
	if _, err := conn.Write(pkt); err != nil {
		tb.Fatalf("forged death: send to %s: %v", addr, err)
	}
}

// msgpackStr appends s as a msgpack string.
func msgpackStr(b []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n < 256:
		b = append(b, 0xd9, byte(n))
	case n < 1<<16:
		b = append(b, 0xda)
		b = binary.BigEndian.AppendUint16(b, uint16(n))
	default:
		panic(fmt.Sprintf("msgpackStr: %d B", n))
	}
	return append(b, s...)
}
