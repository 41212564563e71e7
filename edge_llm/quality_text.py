"""The fixed English text `edge-llm bench quant` measures perplexity on (written for this
benchmark; plain expository prose, no code, so the numbers speak about ordinary language), and the
acceptance prompts a conversion's accuracy record answers (docs/quantization.md, "Accuracy record")."""

FACT = "What is the capital of France?"
# the text prompts README.md and docs/ show as examples (README's France question, docs/fleet.md's
# "Hi"): the one list; edge_llm/qrecord.py answers it, bench/accuracy.py asks FACT first
ACCEPTANCE: tuple[str, ...] = (FACT, "Hi")

QUALITY_TEXT = """\
The bicycle is one of the most efficient machines ever built. A rider on a flat road turns \
most of the energy of the legs into forward motion, and very little is lost to the chain, the \
bearings or the tyres. For this reason the bicycle spread quickly once the basic design had \
settled at the end of the nineteenth century: two wheels of the same size, a diamond-shaped \
frame of steel tubes, pedals that drive the rear wheel through a chain, and air-filled tyres \
that soften the bumps of the road.

Before that design, inventors had tried many others. The earliest machines had no pedals at \
all; the rider sat between two wheels and pushed against the ground with both feet. Later \
versions put the pedals directly on the front wheel, which meant that a larger wheel covered \
more ground with each turn of the pedals. Front wheels grew until they were taller than a \
person, and riding became both fast and dangerous, because a small stone could throw the rider \
over the handlebars. The chain drive solved this problem. With gears of different sizes at the \
pedals and at the rear wheel, a small wheel could turn as fast as a large one, and the rider \
could sit low and safe between the wheels.

The new machines changed daily life in towns and villages. Workers could live farther from \
their factories, doctors could visit patients in the countryside, and young people could meet \
friends in the next village on a Sunday afternoon. Roads improved because cyclists asked for \
smooth surfaces, and many of the first paved country roads were built after cycling clubs had \
argued for them. Some of the skills learned in building bicycles, such as making light and \
strong tubes or precise ball bearings, were later used in the first motor cars and aeroplanes.

Today the bicycle is again seen as a practical answer to several problems at once. It needs \
no fuel, it takes little space in a crowded street, and regular riding keeps the heart and the \
muscles in good condition. Cities that build separate lanes for cyclists often find that the \
number of riders grows year after year, because people feel safe enough to try. Electric \
bicycles, which add a small motor to help on hills and against the wind, have made cycling \
possible for people who live in hilly places or who need to travel longer distances.

Looking after a bicycle is simple compared with most machines. The chain should be cleaned and \
oiled from time to time, the tyres kept at the right pressure, and the brakes checked before a \
long ride. A puncture can be repaired at the side of the road with a patch, a small pump and a \
few minutes of patience. With this modest care, a well-made bicycle can last for decades and \
pass from one owner to the next, which is one more reason why so many people around the world \
still choose it for their daily journeys.
"""
