"""The calibration text `edge-llm convert rknn` runs the F32 model on (docs/npu.md, "Calibration").

Written for edge-llm and dedicated to the public domain (CC0 1.0): anyone may copy, change and
use it for any purpose. It is deliberately mixed — a chat-style question and answer, narrative,
expository prose, a recipe-like list, numbers and dates, Python and C code, a shell session, JSON,
a table, and short passages in other languages — because a w8a8 graph's static int8 scales are
set by what the calibration rows contain, and a runtime request can be any of these. It shares no
sentence with `quality_text.QUALITY_TEXT`, the text the accuracy benchmarks measure on, so the
measured accuracy of a quantized conversion is on text it was not calibrated on."""

CALIB_TOKENS = 4096  # the default cut: all of the text below in any tokenizer we ship

CALIBRATION_TEXT = """\
Question: My board has 16 GB of memory and an eight-core processor. How many requests can it \
serve at once, and what limits that number?

Answer: Start from the memory, not the cores. Each conversation keeps its attention cache for as \
long as it is open, and the cache grows by a fixed number of bytes for every token. Multiply the \
bytes per token by the longest conversation you expect, add the weights once, and leave a margin \
for the operating system. The cores decide how fast each answer comes out, but the memory decides \
how many answers can wait in line without the kernel stopping the service.

The lighthouse keeper's daughter had never seen the mainland in winter. Every autumn, when the \
supply boat made its last crossing, her father packed the oil lamps in straw, counted the tins of \
biscuits twice and wrote the numbers in a green ledger. "Forty-two tins," he said, "and the goat." \
She laughed, because the goat was not in the ledger, and he pretended to be offended. The wind \
came from the north-east that year, steady and cold, and for nineteen days no ship passed. On the \
twentieth morning a fishing boat with a torn sail limped around the point, and the two of them \
rowed out with ropes and a pot of soup. The fishermen stayed three nights. One of them taught her \
to splice a line; another drew a map of the harbour town on the back of a calendar, with the \
bakery, the school and the church marked by little crosses. She kept the map for the rest of her \
life.

Rivers shape the land in two ways at once. Where the current is fast, water lifts sand and \
pebbles from the bed and carries them downstream; where it slows, on the inside of a bend or at \
the mouth of a lake, it drops them again. Over thousands of years this simple exchange moves \
whole valleys. A river that meets the sea in a sheltered bay builds a delta, a fan of new ground \
crossed by channels that shift after every flood. Farmers have always valued these places for \
their soil, and have always feared them for the same reason: the water that brings the soil can \
take the house.

To make bread for four people you need:
- 500 g of flour (about 4 cups),
- 320 ml of lukewarm water,
- 7 g of dried yeast,
- 10 g of salt and a spoon of olive oil.
Mix the flour and the salt, dissolve the yeast in the water, then combine everything and knead \
for ten minutes until the dough is smooth. Let it rise for 1 hour 30 minutes at 24 degrees \
Celsius, shape it, let it rise again for 45 minutes and bake at 230 °C for 35 to 40 minutes.

In 1969 the first message between two computers of what became the internet was sent from a \
university in Los Angeles to a research institute 560 kilometres away. The operator meant to type \
"LOGIN"; the system crashed after "LO". By 1983 the network had moved to the protocols it still \
uses, and by 1995 some 16 million people were online. In 2024 the number passed 5.5 billion, or \
roughly 67 % of the world's population, and the average household owned more than ten connected \
devices: phones, televisions, thermostats, doorbells and, more and more, small computers that \
run language models without any connection at all.

def moving_average(values, window):
    \"\"\"Return the mean of every `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


class RateLimiter:
    def __init__(self, per_second: float, burst: int = 10):
        self.rate, self.burst = per_second, burst
        self.tokens, self.last = float(burst), time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

static int parse_port(const char *s, uint16_t *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\\0' || *end != '\\0' || v < 1 || v > 65535)
        return -EINVAL;
    *out = (uint16_t)v;
    return 0;
}

$ df -h /var/lib
Filesystem      Size  Used Avail Use% Mounted on
/dev/mmcblk0p6   57G   21G   34G  39% /
$ sudo journalctl -u backup.service --since "2 hours ago" | tail -n 3
backup.sh[2211]: copied 1,204 files (3.8 GiB) in 412 s
backup.sh[2211]: verified checksums: 1,204 ok, 0 failed
systemd[1]: backup.service: Deactivated successfully.

{"id": "order-20931", "customer": {"name": "Amina Diallo", "city": "Lyon"}, "items": [{"sku": \
"TEA-014", "qty": 2, "price": 7.5}, {"sku": "CUP-203", "qty": 1, "price": 12.0}], "paid": true, \
"shipped_at": null}

| city      | population (millions) | average January temperature |
|-----------|-----------------------|-----------------------------|
| Oslo      | 0.71                  | -4.3 °C                     |
| Singapore | 5.92                  | 26.5 °C                     |
| Quito     | 2.01                  | 14.0 °C                     |
| Perth     | 2.31                  | 24.6 °C                     |

Dear Mr. Okafor,
Thank you for your letter of 3 March. I am sorry that the replacement part arrived damaged. We \
have sent a new one by express delivery today; the tracking number is JX-4471-0923. You do not \
need to return the broken part. If anything else is wrong, please write to me directly and I will \
make sure it is handled within two working days.
With kind regards,
Lena Hofmann, Customer Service

Le marché ouvre à sept heures. Les premiers clients achètent du pain, des fruits et du fromage, \
puis la place se remplit de familles et de touristes. Vers midi, les marchands rangent leurs \
tables et la rue redevient calme.
Der Zug nach München fährt heute von Gleis 7 ab und hat etwa zwanzig Minuten Verspätung. Wir \
bitten um Ihr Verständnis.
El agua hierve a cien grados al nivel del mar, pero en una montaña alta hierve antes, porque la \
presión del aire es menor.
今天的天气很好，我们下午去公园散步，然后在河边的小饭馆吃晚饭。
明日は朝九時に駅で会いましょう。

User: Can you explain what a hash table is in one paragraph?
Assistant: A hash table stores pairs of keys and values in an array. To find where a key goes, it \
runs the key through a hash function, which turns it into a number, and uses that number modulo \
the array's length as the position. Two keys can land on the same position; the table then keeps \
a short list there, or looks for the next free slot. As long as the table is not too full, adding, \
finding and removing a key each take about the same small time, however many keys it holds, which \
is why almost every programming language offers one.
User: And when does it get slow?
Assistant: When many keys collide, for example because the hash function is poor or an attacker \
chooses keys on purpose, or when the table is allowed to fill up before it grows. Good \
implementations pick a hash function with a random seed and double the array once it is about \
three quarters full.

Solve 3x + 7 = 22. Subtract 7 from both sides: 3x = 15. Divide by 3: x = 5. Check: 3 * 5 + 7 = \
22. The area of a circle of radius 4 cm is pi * 4^2, about 50.27 square centimetres, and its \
circumference is 2 * pi * 4, about 25.13 cm. If a loan of 12,000 dollars is repaid over 36 \
months at 6 % a year, the monthly payment is about 365.06 dollars, and the total interest is \
about 1,142 dollars.

Most of what a small team needs from a build system is boring and predictable: the same command \
should give the same result on every machine, a change to one file should rebuild only what \
depends on it, and a failure should say which step failed and why. Fancy features matter less \
than these three properties. When a build takes longer than a cup of coffee, people stop running \
it before they push, and the time saved by skipping it is paid back, with interest, the first \
time a broken change reaches everyone else.

The old orchard behind the school had eleven apple trees and one pear tree that nobody \
remembered planting. In September the children were allowed to pick the fruit that had fallen, \
and the cook turned it into a sauce that tasted faintly of cinnamon and smoke. Years later, when \
the orchard was sold and the trees were cut down, three of those children, by then grown up, \
bought the pear tree's wood and made a long table from it. It stands today in the village hall, \
scratched and polished, and people still argue about whose initials are carved under its edge.
"""
