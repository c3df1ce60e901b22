// Publishes the messages read from stdin (JSON lines) to JetStream with PublishMsgAsync, at
// most -window awaiting their ack, each deduplicated by its Nats-Msg-Id header, and prints the
// seconds the publishing took (reading the input excluded).
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"
)

type message struct {
	Subject string            `json:"subject"`
	Body    string            `json:"body"`
	Headers map[string]string `json:"headers"`
}

func main() {
	url := flag.String("url", nats.DefaultURL, "")
	window := flag.Int("window", 256, "")
	flag.Parse()
	var msgs []*nats.Msg
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 1<<26)
	for scanner.Scan() {
		var m message
		if err := json.Unmarshal(scanner.Bytes(), &m); err != nil {
			panic(err)
		}
		msg := nats.NewMsg(m.Subject)
		msg.Data = []byte(m.Body)
		for k, v := range m.Headers {
			msg.Header.Set(k, v)
		}
		msgs = append(msgs, msg)
	}
	nc, err := nats.Connect(*url)
	if err != nil {
		panic(err)
	}
	defer nc.Close()
	js, err := nc.JetStream(nats.PublishAsyncMaxPending(*window))
	if err != nil {
		panic(err)
	}
	start := time.Now()
	futures := make([]nats.PubAckFuture, 0, len(msgs))
	for _, msg := range msgs {
		future, err := js.PublishMsgAsync(msg)
		if err != nil {
			panic(err)
		}
		futures = append(futures, future)
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(60 * time.Second):
		panic("acks did not all come within 60s")
	}
	for _, future := range futures {
		select {
		case <-future.Ok():
		case err := <-future.Err():
			panic(err)
		}
	}
	fmt.Printf("%.6f\n", time.Since(start).Seconds())
}
