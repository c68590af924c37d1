"""A small embedded English corpus for the character-level GPT example.

Original prose written for this repository (no downloads, no third-party
text), so the example runs offline and identically everywhere. A few KB is
enough for a tiny model to learn letter frequencies, common words and
spacing within a minute of CPU time.
"""

TEXT = """\
The river town woke slowly. Before the sun cleared the hills, the baker had
already lit his ovens, and the smell of warm bread drifted down the narrow
street toward the water. A cat sat on the step of the closed post office and
watched the gulls argue over something on the pier. Nobody else was awake yet,
or if they were, they were keeping quiet about it.

By seven the ferry had come in. It was a small boat, painted white and blue,
with a bell that rang twice when it touched the dock. The same people came off
it every morning: the teacher with her bag of books, the two brothers who
fixed engines, the old man who sold maps that nobody needed anymore. He said
good morning to everyone, and everyone said good morning back, because that
was how the town had always done things.

The teacher walked up the hill to the school. She liked the walk. It gave her
time to think about the day, about which of the children would be tired and
which would be loud, and about the lesson she had planned the night before.
Today it was rivers. She had a jar of water from the river in her bag, and a
small lamp, and a piece of white paper. She wanted the children to see how
much was living in a single drop.

In the workshop by the harbor, the brothers opened the doors and let the
light in. There was a motor on the bench that had been there for a week. It
belonged to a fisherman who had gone north for the season, and he had said
there was no hurry. Still, the older brother did not like to leave a job
unfinished. He took the cover off and looked inside for a long time without
saying anything. The younger brother made tea and waited. He knew that look.
It meant the problem was simple, and that his brother was annoyed that he had
not seen it sooner.

At noon the market filled the square. There were tables of apples and pears,
baskets of eggs, round cheeses wrapped in cloth, and bunches of flowers in
buckets of cold water. A woman sold honey in small glass jars, and she let
the children taste it from a wooden spoon. A man played a violin near the
fountain, not very well, but with great feeling, and people dropped coins
into his open case as they passed. The map seller set up his table in the
shade and unfolded a chart of the coast that was older than anyone in town.

The afternoon was quiet. Clouds came in from the sea and the light turned
soft and gray. In the school, the children pressed their faces close to the
paper and watched tiny shapes swim across the circle of lamplight. One boy
said it looked like a city seen from very high up. One girl said it looked
like nothing she had ever seen, and that she wanted to see it again tomorrow.
The teacher wrote both answers on the board, because she thought they were
both right.

When the motor finally ran, the sound filled the whole workshop. The older
brother listened to it with his head tilted, the way some people listen to
music. Then he switched it off, wiped his hands, and said that a single loose
wire had caused all the trouble. The younger brother laughed and said that
it was always a single loose wire. They cleaned the bench, hung up their
tools, and sat outside on a crate to watch the boats come home.

In the evening the ferry rang its bell again. The teacher came down the hill
with an empty jar. The map seller folded his old chart and carried his table
back to the boat. The baker sold the last of his bread at half price and then
gave the rest away. Lights came on in the windows one by one, and the river
carried their reflections out toward the sea, where the water was wide and
dark and full of small living things that nobody could see.

The cat had moved from the post office step to the wall above the harbor. It
watched the last boat tie up, and the last gull settle, and the last window go
dark. Then it closed its eyes. Tomorrow the town would wake slowly again, and
the bread would be warm, and the ferry would ring its bell twice, and someone
would say good morning, and someone would say good morning back.

A good tool is one you forget you are holding. A good road is one you forget
you are walking on. A good day, the old map seller liked to say, is one where
you end up exactly where you meant to go, and you learn on the way that there
was a better place nearby. People smiled when he said it, and some of them
wrote it down, and most of them forgot it by the time they reached home. That
was fine with him. He said that the best advice is the kind you find again
later, when you need it, folded up in a pocket you had not checked.
"""
