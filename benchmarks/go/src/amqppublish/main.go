// Publishes the messages read from stdin (JSON lines) with confirms, at most -window awaiting
// their confirm, and prints the seconds the publishing took (reading the input excluded).
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

type message struct {
	Key           string            `json:"key"`
	Body          string            `json:"body"`
	MessageID     string            `json:"message_id"`
	Type          string            `json:"type"`
	Timestamp     int64             `json:"timestamp"`
	CorrelationID string            `json:"correlation_id"`
	Headers       map[string]string `json:"headers"`
}

func main() {
	url := flag.String("url", "amqp://guest:guest@127.0.0.1:5672/", "")
	exchange := flag.String("exchange", "", "")
	window := flag.Int("window", 256, "")
	flag.Parse()
	var publishings []amqp.Publishing
	var keys []string
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 1<<26)
	for scanner.Scan() {
		var m message
		if err := json.Unmarshal(scanner.Bytes(), &m); err != nil {
			panic(err)
		}
		headers := amqp.Table{}
		for k, v := range m.Headers {
			headers[k] = v
		}
		publishings = append(publishings, amqp.Publishing{
			Headers: headers, ContentType: "application/json", DeliveryMode: amqp.Persistent,
			CorrelationId: m.CorrelationID, MessageId: m.MessageID, Type: m.Type,
			Timestamp: time.Unix(m.Timestamp, 0), Body: []byte(m.Body),
		})
		keys = append(keys, m.Key)
	}
	conn, err := amqp.Dial(*url)
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		panic(err)
	}
	if err := ch.Confirm(false); err != nil {
		panic(err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, *window))
	start := time.Now()
	outstanding := 0
	await := func() {
		c := <-confirms
		if !c.Ack {
			panic("nacked")
		}
		outstanding--
	}
	for i, p := range publishings {
		if outstanding == *window {
			await()
		}
		if err := ch.Publish(*exchange, keys[i], true, false, p); err != nil {
			panic(err)
		}
		outstanding++
	}
	for outstanding > 0 {
		await()
	}
	fmt.Printf("%.6f\n", time.Since(start).Seconds())
}
