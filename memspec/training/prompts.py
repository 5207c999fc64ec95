"""Domain prompts for draft self-distillation: templates x topics, deterministic.

`domain_prompts(domain, n, seed)` returns `n` distinct user messages for one of
DOMAINS.  The target answers them (greedy) and the drafts learn to predict its
answers, so the prompts only need to cover what users ask in that domain.
`measured_prompts()` are the prompts the benchmarks measure drafts on; training never uses them,
nor near copies of them (`near_measured`): a prompt that holds most of a measured prompt's content
words is the same task with other words around it, and a draft trained on the target's answer to
it would be measured on what it memorized.  domain_prompts never returns one.
"""

from __future__ import annotations

import math
import random
import re
from functools import lru_cache
from pathlib import Path

DOMAINS = ("code", "math", "chat", "scripts", "text", "qa", "creative")

CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "compute the factorial of n",
    "return the n-th Fibonacci number", "find the largest element in a list", "remove duplicates from a list",
    "count the vowels in a string", "check whether a string is a palindrome", "merge two sorted lists",
    "sort a list with bubble sort", "implement binary search", "flatten a nested list",
    "compute the greatest common divisor of two numbers", "convert Celsius to Fahrenheit",
    "read a text file and count its lines", "count word frequencies in a text", "transpose a matrix",
    "check whether two strings are anagrams", "find the second largest number in a list",
    "compute the sum of the digits of an integer", "convert a decimal number to binary",
    "validate an email address", "find all even numbers in a list", "capitalize every word in a sentence",
    "compute the average of a list of numbers", "implement a stack class", "implement a queue with two stacks",
    "find the intersection of two lists", "rotate a list by k positions", "check if a year is a leap year",
    "generate all permutations of a string", "compute the power set of a set", "parse a CSV file into dictionaries",
    "find the longest word in a sentence", "implement quicksort", "implement merge sort",
    "compute the n-th triangular number", "check whether parentheses are balanced", "find the mode of a list",
    "convert a Roman numeral to an integer", "reverse a linked list", "compute the dot product of two vectors",
    "remove whitespace from a string", "find the median of a list", "count the occurrences of each character",
    "split a list into chunks of size n", "compute the least common multiple", "find missing numbers in a range",
    "implement a simple calculator", "serialize a dictionary to JSON", "fetch a web page and print its title",
    "sum all the numbers in a nested list", "find the first non-repeating character in a string",
    "check whether a number is a perfect square", "compute compound interest", "shuffle a list randomly",
    "group a list of words by their first letter", "find the maximum subarray sum",
    "convert a string to title case", "implement a binary tree insertion",
    "debounce another function", "find the k most common words in a text", "check whether a list is sorted",
    "compute the running total of a list", "count the lines, words and characters of a file",
    "find the longest common prefix of a list of strings", "implement a least-recently-used cache",
    "convert a list of dictionaries to a CSV file", "compute the Levenshtein distance between two strings",
    "find all prime numbers up to n with the sieve of Eratosthenes", "implement breadth-first search on a graph",
    "implement depth-first search on a graph", "compute the moving average of a list", "zip two lists into a dictionary",
    "sort a list of dictionaries by a key", "find duplicate files by their size", "retry a function call three times",
    "measure how long a function takes to run", "read a JSON file and print one field", "reverse the words in a sentence",
    "check whether a string contains only digits", "compute the factorial of n recursively",
    "implement a counter class with increment and reset methods", "find the index of the minimum element",
    "convert hours and minutes to seconds", "compute the Euclidean distance between two points",
    "remove all vowels from a string", "check whether a number is an Armstrong number",
    "generate a random password", "implement a simple bank account class",
]
CODE_TEMPLATES = [
    "Write a Python function to {t}.",
    "How do I {t} in Python? Show the code.",
    "Write a JavaScript function to {t}.",
    "Write a short Python script to {t} and explain it briefly.",
    "Implement a function in C to {t}.",
    "Give me a Python example that shows how to {t}.",
    "Write a Java method to {t}.",
    "Write a Python class or function to {t}, with a docstring and a usage example.",
    "Write a TypeScript function to {t}.",
    "Write a C++ function to {t}.",
    "Write a Go function to {t}.",
    "Write a Rust function to {t}.",
    "Write a Python function that can {t}, and add a few test cases.",
    "Show me how to {t} in JavaScript.",
]
CODE_EXTRA = [  # whole prompts: shell, SQL and other languages' idioms
    "Write a bash script that prints the size of every file in a directory.",
    "Write a bash script that counts the lines of every .txt file in the current directory.",
    "Write a bash script that backs up a folder into a dated tar.gz archive.",
    "Write a bash one-liner that finds the ten largest files under /var/log.",
    "Write a bash script that checks whether a website is up and prints the status code.",
    "Write a SQL query that returns the ten most recent orders from a table orders(id, customer_id, created_at).",
    "Write a SQL query that counts the customers in each country from a table customers(id, name, country).",
    "Write a SQL query that finds the employees who earn more than their department's average salary.",
    "Write a SQL query that joins the tables users(id, name) and posts(id, user_id, title) and counts posts per user.",
    "Write a SQL statement that creates a table products with id, name, price and stock columns.",
    "Write a SQL query that returns the second highest salary from a table employees(id, name, salary).",
    "Write an HTML page with a form that asks for a name and an email address.",
    "Write a CSS rule that centers a div horizontally and vertically.",
    "Write a Dockerfile for a small Python web application.",
    "Write a regular expression that matches a valid IPv4 address and explain it.",
    "Write a Python decorator that caches the results of a function.",
    "Write a Python context manager that times the code inside it.",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Write a Python dataclass for a book with title, author and year.",
    "Write a Python script that uses argparse to read a file name and prints its contents.",
]
SQL_TASKS = [  # "Write a SQL query that {t}."
    "returns the five customers with the most orders from tables customers(id, name) and orders(id, customer_id)",
    "lists every product that has never been ordered, from products(id, name) and order_items(product_id)",
    "computes the total sales per month from a table sales(id, amount, sold_at)",
    "finds duplicate email addresses in a table users(id, email)",
    "returns the average salary per department from employees(id, department, salary)",
    "deletes the rows older than 30 days from a table logs(id, created_at)",
    "updates the price of every product in the category books by ten percent",
    "returns the top three highest paid employees in each department",
    "counts the orders per customer and keeps only customers with more than five",
    "joins students(id, name), courses(id, title) and enrollments(student_id, course_id)",
    "returns the customers who placed an order in 2023 but not in 2024",
    "finds the day with the highest revenue from orders(id, total, created_at)",
    "creates an index on the email column of a users table",
    "returns the running total of payments(id, amount, paid_at) ordered by date",
    "returns each customer's most recent order date",
    "lists the departments with no employees from departments(id, name) and employees(id, department_id)",
    "computes the percentage of orders that were cancelled from orders(id, status)",
    "returns the names of employees and their managers from employees(id, name, manager_id)",
    "returns the product with the highest stock from products(id, name, stock)",
    "inserts three rows into a table products(id, name, price)",
]
SHELL_TASKS = [  # "Write a bash script that {t}."
    "prints the number of files in every subfolder", "renames every .jpeg file to .jpg",
    "counts how many files of each extension a folder holds", "deletes log files older than seven days",
    "prints the ten most frequent words of a text file", "checks whether a process is running and starts it if not",
    "prints the free disk space of every mounted filesystem", "compresses every folder in the current directory",
    "reads a file line by line and prints the line numbers", "downloads a list of URLs from a file",
    "prints the total number of lines of all Python files in a project", "creates a dated backup of a folder",
    "prints the memory used by each running process", "finds every file containing the word TODO",
    "loops over the numbers 1 to 10 and prints the even ones", "asks for a name and greets the user",
    "prints the five largest files under the home directory", "replaces a word in every .txt file",
    "monitors a log file and prints lines containing ERROR", "prints the current date, user and hostname",
]
DATA_TASKS = [  # Python data handling, the kind of task users bring
    "reads a CSV file and prints the number of rows per value of its first column",
    "reads two text files and prints the lines they have in common",
    "reads a JSON file of users and prints the names of those older than 30",
    "groups the rows of a CSV file by a column and sums another",
    "removes the duplicate lines of a text file", "merges two CSV files on a shared id column",
    "finds the longest line in a text file", "converts a CSV file to a list of dictionaries",
    "writes a list of dictionaries to a JSON file", "computes the mean, median and standard deviation of a list",
    "counts the lines of a log file that contain the word ERROR", "reads a text file and counts its sentences",
    "filters a list of dictionaries by the value of a key", "sorts the rows of a CSV file by a numeric column",
    "computes the word count of every .txt file in a folder",
]

MATH_TEMPLATES = [
    "Solve step by step: {a} * {b} + {c}",
    "What is {p}% of {n}? Show your work.",
    "Solve for x: {a}x + {b} = {c}. Explain each step.",
    "Calculate the area of a rectangle with length {a} cm and width {b} cm.",
    "A train travels {n} km in {b} hours. What is its average speed? Think step by step.",
    "What is the sum of the first {a} positive integers? Explain the method.",
    "Simplify the fraction {n}/{m}.",
    "A shop sells pencils for ${b} each. If Sarah buys {c} pencils and pays with a ${n} bill, how much change does she get?",
    "Find the derivative of f(x) = {a}x^3 + {b}x^2 - {c}x + 7. Show the steps.",
    "What is the perimeter of a triangle with sides {a}, {b} and {c}?",
    "Tom has {n} apples. He gives {a} to his friend and buys {c} more. How many apples does he have now? Solve step by step.",
    "Convert {n} minutes into hours and minutes.",
    "What is the average of {a}, {b}, {c} and {n}? Show your calculation.",
    "Solve the system of equations: x + y = {n}, x - y = {a}.",
    "What is {a} squared plus {b} squared?",
    "A recipe needs {b} cups of flour for {a} cookies. How much flour is needed for {n} cookies?",
    "Is {n} a prime number? Explain how you check.",
    "Calculate the simple interest on ${n} at {p}% per year for {b} years.",
    "What is the area of a circle with radius {a}? Use pi = 3.14 and show the steps.",
    "Explain step by step how to compute {n} divided by {b}.",
    "If a car uses {b} liters of fuel per 100 km, how much fuel does it need for {n} km?",
    "Factor the expression x^2 + {s}x + {q}.",
    "What is the least common multiple of {a} and {b}? Show the steps.",
    "A rectangle has a perimeter of {e} meters and a length of {a} meters. What is its width?",
    "Explain how to solve a quadratic equation, using x^2 - {s}x + {q} = 0 as an example.",
    "What is {a} multiplied by {c}? Show your work step by step.",
    "A book costs ${n} after a {p}% discount. What was the original price? Think step by step.",
    "The sum of two numbers is {n} and their difference is {a}. What are the numbers? Solve step by step.",
    "A rectangle has a perimeter of {e} cm and a length of {a} cm. What is its area? Show your reasoning.",
    "If {b} workers can build a wall in {c} days, how long would {a} workers take? Explain step by step.",
    "What is {n} divided by {b}, rounded to two decimal places? Show the steps.",
    "Convert {n} kilometers to miles. Show the calculation.",
    "A store increases the price of a ${n} item by {p}%. What is the new price? Step by step.",
    "Find the mean, median and mode of these numbers: {a}, {b}, {c}, {b}, {n}.",
    "What is {a} to the power of 3? Explain the calculation.",
    "A tank holds {n} liters and drains at {b} liters per minute. How long until it is empty? Step by step.",
    "Solve the inequality {a}x - {b} > {c}. Show each step.",
    # phrasings and numbers that the first set lacks: decimals, unit prices, rates, ratios, other
    # closing instructions ("Explain how you calculate it.")
    "A cyclist rides {d} km in {h} hours. What is her average speed in km per hour? Explain step by step.",
    "A shop sells apples at {k} for {c} cents. How much do {n} apples cost? Think step by step.",
    "What is {p}% of {n}? Explain how you calculate it.",
    "What is {a} times {c}? Explain how you calculate it.",
    "Compute {n} minus {c}, then multiply the result by {b}. Show each step.",
    "If {k} notebooks cost ${b}, how much do {a} notebooks cost? Solve step by step.",
    "Solve for y: {b}y - {c} = {n}. Show each step.",
    "Solve for x: x/{b} + {a} = {c}. Explain your steps.",
    "A worker earns ${b} per hour and works {c} hours a week. How much does she earn in {k} weeks? Step by step.",
    "A bottle holds {d} liters. How many bottles are needed for {n} liters? Explain step by step.",
    "What is {d} plus {h}? Show your work.",
    "A square has a side of {a} cm. What are its perimeter and its area? Show your reasoning.",
    "A pizza is cut into {m} slices and {k} friends eat {b} slices each. How many slices are left? Think step by step.",
    "The ratio of boys to girls in a class is {k}:{b}, and there are {e} students. How many girls are there? Solve step by step.",
    "A jacket costs ${n} and is on sale for {p}% off. What is the sale price? Explain how you calculate it.",
    "What is the volume of a box that is {a} cm long, {b} cm wide and {k} cm high? Show the steps.",
    "If it takes {k} hours to paint {b} rooms, how long does it take to paint {c} rooms at the same rate? Step by step.",
    "Lisa reads {c} pages a day. How many days does she need for a book of {n} pages? Explain your answer.",
    "Write {n}/{m} as a decimal and as a percentage. Show the steps.",
    "Round {d} to the nearest whole number and explain why.",
    "A phone plan costs ${b} a month plus ${k} per gigabyte. How much is a month with {a} gigabytes? Step by step.",
    "Find two consecutive integers whose sum is {o}. Solve step by step.",
    "The angles of a triangle are {t} degrees and {u} degrees. What is the third angle? Explain step by step.",
    "How many seconds are there in {b} hours? Show your calculation.",
    "A farmer has {n} eggs and packs them in boxes of {m}. How many full boxes does he get, and how many eggs are left? Step by step.",
]

CHAT_TEMPLATES = [
    "Tell me a short story about {x}.",
    "Explain {y} in simple terms.",
    "What is {y}?",
    "Give me some tips for {z}.",
    "Write a short poem about {x}.",
    "Why is {y} important?",
    "Describe a day in the life of {x}.",
    "Can you help me understand {y}?",
    "What are the benefits of {z}?",
    "Write a friendly email to a colleague about {z}.",
    "Summarize the history of {y} in a few sentences.",
    "Tell me a fun fact about {x}.",
    "Write a short story about {x}.",
    "Write a bedtime story about {x}.",
    "How does {y} work?",
    "Write a haiku about {x}.",
    "What should I know before {z}?",
    "Write a short speech about {y} for a school assembly.",
    "Describe {x} in a few vivid sentences.",
    "What are common mistakes people make when {z}?",
    "Answer briefly: what causes {y}?",
    "Explain {y} to a ten-year-old.",
    "What is the difference between {y} and {y2}?",
    "Write a diary entry from the point of view of {x}.",
    "I am nervous about {z}. Any advice?",
    "Write a dialogue between two friends about {z}.",
    "List three interesting facts about {y}.",
    "Write the opening paragraph of a novel about {x}.",
    "How would you explain {y} to someone who has never heard of it?",
    "Give me a step-by-step plan for {z}.",
]
CHAT_SUBJECTS = [
    "a brave little mouse", "a robot who learns to paint", "a lighthouse keeper", "a dragon who is afraid of fire",
    "a lost puppy", "an old sailor", "a girl who finds a magic key", "a talking tree", "the moon", "the ocean",
    "a busy bee", "a city at night", "a snowy mountain village", "a clever fox", "a young astronaut",
    "a forgotten library", "a friendly ghost", "autumn leaves", "a baker in Paris", "a cat and a dog who become friends",
    "a penguin who wants to fly", "a little star that wants to visit the Earth", "a boy who finds a talking map",
    "a cloud that wants to become rain", "a busy market on a Saturday morning", "a secret door in a school library",
    "a quiet morning in the mountains", "an old clock that stops time", "a whale who sings", "a garden in spring",
    "a retired firefighter", "a shy giraffe", "a train that travels between dreams", "a pirate who loves books",
    "a small town during a storm", "an owl who cannot sleep at night", "two siblings on a road trip",
    "a musician who lost her voice", "a snowman who wants to see summer", "a kite caught in a tree",
    "a grandmother's recipe book", "a scientist who discovers a new color", "a fisherman and a seagull",
    "a tiny island with one tree", "a knight who is afraid of the dark", "a squirrel preparing for winter",
    "a bus driver on his last day", "a forest after the rain", "a turtle who wants to win a race",
    "a girl who can talk to birds", "a haunted bicycle", "a family of hedgehogs", "a desert caravan",
    "a paper boat on a long journey", "a chef who cannot taste", "a dog waiting at the train station",
]
CHAT_TOPICS = [
    "photosynthesis", "gravity", "the water cycle", "climate change", "the internet", "democracy", "vaccines",
    "black holes", "machine learning", "the French Revolution", "recycling", "the human heart", "electricity",
    "volcanoes", "the stock market", "renewable energy", "the Roman Empire", "DNA", "sleep", "inflation",
    "the solar system", "bees and pollination", "meditation", "the printing press", "rainbows",
    "the seasons", "earthquakes", "the immune system", "the moon landing", "antibiotics", "tides", "clouds",
    "the Great Wall of China", "coffee", "the human brain", "batteries", "airplanes", "chocolate", "the Olympic Games",
    "photosynthesis in the ocean", "the Renaissance", "the industrial revolution", "plate tectonics", "wind power",
    "the nervous system", "coral reefs", "nuclear energy", "the theory of evolution", "the Silk Road",
    "hurricanes", "blockchain", "the ozone layer", "the human skeleton", "bacteria", "the Amazon rainforest",
    "supply and demand", "the speed of light", "ancient Egypt", "glaciers", "the digestive system",
    "solar panels", "the United Nations", "honey", "magnets", "the printing of money", "desert ecosystems",
    "the history of writing", "rain forests", "the human eye", "compound interest", "the water table",
    "the invention of the telephone", "migration of birds", "the periodic table", "fermentation",
]
CHAT_ACTIVITIES = [
    "learning a new language", "staying productive when working from home", "getting better sleep",
    "eating healthy on a budget", "running your first marathon", "saving money", "reading more books",
    "reducing stress", "traveling on a budget", "learning to cook", "gardening", "public speaking",
    "making new friends", "keeping a journal", "regular exercise",
    "moving to a new city", "starting a small business", "adopting a dog", "learning to play the guitar",
    "preparing for a job interview", "planning a birthday party", "studying for exams", "camping in the woods",
    "cutting down on sugar", "waking up early", "taking care of houseplants", "learning to swim",
    "writing a resume", "organizing a messy room", "cycling to work", "teaching a child to read",
    "volunteering in your community", "baking bread at home", "managing your time", "hiking in the mountains",
]


def _code(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return rng.choice(CODE_EXTRA)
    return rng.choice(CODE_TEMPLATES).format(t=rng.choice(CODE_TASKS))


def _scripts(rng: random.Random) -> str:
    """SQL, shell and Python data tasks: the code a user brings besides algorithms."""
    kind = rng.random()
    if kind < 0.35:
        form = rng.choice(["Write a SQL query that {t}.", "How do I write a SQL query that {t}?",
                           "Write a PostgreSQL query that {t}, and explain it briefly."])
        return form.format(t=rng.choice(SQL_TASKS))
    if kind < 0.7:
        form = rng.choice(["Write a bash script that {t}.", "How can I write a shell script that {t}?",
                           "Write a short bash script that {t}, with comments."])
        return form.format(t=rng.choice(SHELL_TASKS))
    form = rng.choice(["Write a Python function that {t}.", "Write a Python script that {t}.",
                       "Show me Python code that {t}."])
    return form.format(t=rng.choice(DATA_TASKS))


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 25), rng.randint(2, 12), rng.randint(3, 40)
    s, q = rng.randint(2, 6), rng.randint(1, 5)
    k, t = rng.randint(2, 6), rng.randint(20, 80)
    return rng.choice(MATH_TEMPLATES).format(
        a=a, b=b, c=c, n=rng.randint(30, 480), m=rng.choice([4, 6, 8, 12, 16, 24]),
        p=rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75]), s=s + q, q=s * q, e=2 * a + 2 * rng.randint(1, a),
        k=k, d=round(rng.uniform(1.5, 99.5), 1), h=rng.choice([1.5, 2.5, 3.5, 0.5, 1.25, 2.75]), o=2 * a + 1,
        t=t, u=rng.randint(20, 160 - t),
    )


def _chat(rng: random.Random) -> str:
    y, y2 = rng.sample(CHAT_TOPICS, 2)
    return rng.choice(CHAT_TEMPLATES).format(
        x=rng.choice(CHAT_SUBJECTS), y=y, y2=y2, z=rng.choice(CHAT_ACTIVITIES)
    )

# "text": instructions over a text the user gives (summarize, extract, rewrite, convert).  The
# target's answers copy and reshape the given text, so a draft that learns to follow it accepts
# well; the passages are composed from the pools below, so that no two prompts share one.
PEOPLE = ["Maria Lopez", "James Chen", "Aisha Khan", "Tom Becker", "Yuki Tanaka", "Lena Novak", "Omar Haddad",
          "Sofia Rossi", "David Kim", "Nora Lindqvist", "Carlos Silva", "Emma Dubois", "Ravi Patel", "Grace Okafor"]
CITIES = ["Madrid", "Toronto", "Berlin", "Nairobi", "Osaka", "Lisbon", "Chicago", "Prague", "Lima", "Sydney",
          "Dublin", "Seoul", "Cairo", "Oslo", "Vancouver", "Milan"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
VENUES = ["the city museum", "a small cafe near the station", "the university library", "the town hall",
          "a conference center", "the old harbor", "a hotel by the river", "the science park"]
NOTICES = [  # (place, reason, what people can do meanwhile)
    ("The swimming pool", "the changing rooms are renovated", "use the pool in the sports center"),
    ("The main post office", "the roof is repaired", "send parcels from the shop on Market Street"),
    ("The community garden", "new paths and benches are built", "pick up their vegetables at the school gate"),
    ("The north parking lot", "the surface is repainted", "park in the garage behind the cinema"),
    ("The school cafeteria", "a new kitchen is installed", "buy lunch from the food truck in the yard"),
    ("The public library", "the heating system is replaced", "return books at the drop box by the door"),
    ("The bus station", "the waiting hall is extended", "catch their buses at the temporary stop on Elm Road"),
    ("The city gym", "the floors are replaced", "join the free outdoor classes in the park"),
]
STRUCTURES = [("bridge", "cars"), ("tunnel", "trains"), ("dam", "visitors"), ("stadium", "fans"),
              ("ferry terminal", "passengers"), ("highway", "trucks"), ("tower", "tourists")]
PRODUCTS = [("a blue backpack", 35), ("a water bottle", 12), ("a pair of running shoes", 80), ("a desk lamp", 24),
            ("a rain jacket", 60), ("a notebook", 4), ("a phone case", 15), ("a coffee mug", 9),
            ("a wool scarf", 22), ("a bicycle helmet", 45), ("a travel pillow", 18), ("a set of pens", 7)]
EMAIL_ITEMS = [
    "the release is moved to {day} because the payment tests failed",
    "the team lunch is on {day} at noon in the big meeting room",
    "the office will be closed on {day} for the electrical inspection",
    "the client demo moved to {day} morning",
    "our quarterly review is on {day}, so please update your reports",
    "the new laptops arrive on {day}",
]
EMAIL_ASKS = ["fix your open bugs by {day}", "send me your slides by {day}", "book your travel before {day}",
              "reply to the survey by {day}", "clean your desks before {day}", "update the wiki page by {day}"]
EMAIL_EXTRAS = ["Ana will cover the support rotation.", "Remember to bring your badge.",
                "Coffee and snacks will be provided.", "Ask me if anything is unclear.",
                "The parking garage will be closed that day.", "Please keep the meeting under an hour."]
STORY_PAIRS = [("a young fox", "a lost puppy", "the forest"), ("an old owl", "a frightened kitten", "the barn"),
               ("a little girl", "a wounded bird", "the garden"), ("a fisherman", "a baby seal", "the harbor"),
               ("a shy rabbit", "a lost duckling", "the meadow"), ("a farmer", "a stray goat", "the hills"),
               ("a boy", "a runaway kite", "the park"), ("a crow", "a lost ring", "the market")]
PROS_CONS = [
    ("Remote work", ["saves commuting time", "lets people focus"], ["makes collaboration harder", "blurs the line between work and home"]),
    ("Electric cars", ["produce no exhaust", "are cheap to run"], ["cost more to buy", "need long charging stops"]),
    ("Living in a big city", ["offers many jobs", "has good public transport"], ["is expensive", "can be noisy and crowded"]),
    ("Online classes", ["are flexible", "can be taken from anywhere"], ["need a lot of self-discipline", "offer little contact with teachers"]),
    ("Solar panels", ["lower electricity bills", "need little maintenance"], ["are costly to install", "produce less power in winter"]),
    ("Owning a dog", ["keeps you active", "gives you company"], ["takes a lot of time", "makes travel harder"]),
    ("Buying a used car", ["is much cheaper", "avoids the first years of value loss"], ["may need more repairs", "comes with a shorter warranty"]),
]
PARAGRAPHS = [
    "Regular exercise strengthens the heart and lungs. It also improves mood, because the body releases chemicals that reduce stress. Even a short daily walk can lower the risk of many diseases.",
    "Coral reefs cover less than one percent of the ocean floor, yet they shelter about a quarter of all marine species. Warmer water causes corals to lose the algae they live with, and the reefs turn white.",
    "The printing press, built by Johannes Gutenberg around 1440, made books far cheaper. Ideas spread faster across Europe, and more people learned to read.",
    "Volcanoes form where molten rock rises through cracks in the Earth's crust. When pressure builds up, the magma escapes as lava, ash and gas. Some eruptions change the weather for years.",
    "Recycling paper saves trees, water and energy. One ton of recycled paper can save about 17 trees. However, paper can only be recycled a few times before its fibers become too short.",
    "Honey never spoils when it is stored properly. Its low water content and natural acids stop bacteria from growing. Jars of honey thousands of years old have been found in Egyptian tombs.",
    "Trains are one of the most energy-efficient ways to travel. A full train uses far less fuel per passenger than cars or planes, and many trains now run on electricity.",
    "Drinking enough water helps the body control its temperature and carry nutrients to the cells. Most adults need about two liters a day, more in hot weather or during exercise.",
    "The Great Barrier Reef is the largest living structure on Earth and can be seen from space. It stretches for more than 2,300 kilometers along the coast of Australia.",
    "Libraries today do much more than lend books. Many offer free internet access, language classes, help with job applications and quiet places to study.",
    "Bamboo is one of the fastest-growing plants in the world: some species grow almost a meter in a single day. It is strong and light, so it is used for floors, furniture and even bridges.",
    "Birds migrate to find food and safe places to raise their young. Some fly thousands of kilometers each year, using the sun, the stars and the Earth's magnetic field to find their way.",
]
INFORMAL = ["hey, can u check the numbers again pls", "gonna be late, traffic is crazy", "thx for the help, ur the best",
            "cant make it to the meeting, sry", "pls send the slides asap", "the printer is broken again lol",
            "whats the plan for tmrw?", "ok cool, lets do it on friday", "btw the client called, call them back",
            "need the budget numbers by tonight, ok?"]
RUDE = ["give me the report now.", "fix this mistake today.", "stop sending me these emails.", "answer my question.",
        "move your car.", "call me back right away.", "send the money tomorrow.", "tell me why this is late."]
BAD_GRAMMAR = ["She don't like apples and she have two cat.", "He go to school every days and he like it.",
               "They was happy because the weather were nice.", "Me and him goes to the park on sundays.",
               "I has three brother and one sisters.", "The childs is playing in the gardens.",
               "We was waiting since two hours.", "She can sings very good.", "There is many reason for this problem.",
               "He don't know nothing about it.", "Yesterday I buyed a new bike.", "The informations are not correct."]
ACTIVE = ["The committee approved the budget. The manager announced the decision. The staff celebrated the news.",
          "The chef prepared the meal. The waiter served the guests. The guests praised the food.",
          "The storm damaged the roof. The workers repaired it. The owner paid the bill.",
          "The teacher graded the tests. The students read their results. The parents signed the reports.",
          "The company released a new phone. Critics reviewed it. Millions of people bought it.",
          "The mayor opened the bridge. The police closed the old road. Drivers used the new route."]
TECHNICAL = ["Photosynthesis is the process by which plants convert light energy into chemical energy.",
             "Evaporation occurs when liquid water absorbs heat and changes into water vapor.",
             "Vaccines stimulate the immune system to produce antibodies against a specific pathogen.",
             "Inflation is a sustained increase in the general price level of goods and services.",
             "Erosion is the gradual removal of soil and rock by wind, water or ice.",
             "The heart pumps oxygenated blood through the arteries to the tissues of the body.",
             "Friction is a force that opposes the relative motion of two surfaces in contact.",
             "Gravity is the attractive force that bodies with mass exert on one another."]
NOTES = ["meeting moved - {day} {h}pm - room {r} - bring laptop", "dentist - {day} {h}am - call if late",
         "team dinner - {day} {h}pm - Italian place - book table for {n}",
         "project deadline - {day} - send draft to {p} - review after",
         "flight {day} {h}am - taxi at {h2}am - hotel booked for {n} nights",
         "gym class cancelled {day} - next one {day2} {h}pm - same room"]
PAIRS = [("Fruit", "Color", [("apple", "red"), ("banana", "yellow"), ("grape", "purple"), ("lime", "green"), ("plum", "purple"), ("orange", "orange")]),
         ("City", "Country", [("Paris", "France"), ("Tokyo", "Japan"), ("Cairo", "Egypt"), ("Lima", "Peru"), ("Oslo", "Norway"), ("Rome", "Italy")]),
         ("Animal", "Sound", [("dog", "bark"), ("cat", "meow"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"), ("owl", "hoot")]),
         ("Planet", "Moons", [("Earth", "1"), ("Mars", "2"), ("Venus", "0"), ("Neptune", "16"), ("Mercury", "0"), ("Uranus", "28")]),
         ("Language", "Creator", [("Python", "Guido van Rossum"), ("C", "Dennis Ritchie"), ("Java", "James Gosling"), ("Ruby", "Yukihiro Matsumoto"), ("Perl", "Larry Wall")])]


def _passage(rng: random.Random) -> str:
    """A short text of one of several kinds, with its names, places, days and numbers drawn."""
    kind = rng.randrange(6)
    if kind == 0:
        place, reason, meanwhile = rng.choice(NOTICES)
        weeks = rng.choice(["one week", "two weeks", "three weeks", "a month"])
        return (f"{place} will close for {weeks} in {rng.choice(MONTHS)} while {reason}. Residents can {meanwhile} "
                f"during that time. It reopens on {rng.choice(DAYS)}, {rng.choice(MONTHS)} {rng.randint(1, 28)}.")
    if kind == 1:
        a, b = rng.sample(PEOPLE, 2)
        c1, c2 = rng.sample(CITIES, 2)
        return (f"On {rng.choice(MONTHS)} {rng.randint(1, 28)}, {2015 + rng.randint(0, 10)}, {a} flew from {c1} to {c2} "
                f"to meet {b}. They spent two days at {rng.choice(VENUES)} and agreed to meet again in {c1} in "
                f"{rng.choice(MONTHS)}.")
    if kind == 2:
        what, users = rng.choice(STRUCTURES)
        return (f"The {what} is {rng.randint(2, 60) * 100:,} meters long, {rng.randint(8, 60)} meters wide and was opened in "
                f"{rng.randint(1890, 2020)}. It serves about {rng.randint(5, 120) * 1000:,} {users} a day and cost "
                f"{rng.randint(20, 900)} million dollars to build.")
    if kind == 3:
        day, day2 = rng.sample(DAYS[:5], 2)
        lines = [rng.choice(EMAIL_ITEMS).format(day=day), rng.choice(EMAIL_ASKS).format(day=day2)]
        return f"Hi team, {lines[0]}. Please {lines[1]}. {rng.choice(EMAIL_EXTRAS)} Thanks, {rng.choice(PEOPLE).split()[0]}"
    if kind == 4:
        hero, lost, where = rng.choice(STORY_PAIRS)
        return (f"{hero[0].upper() + hero[1:]} found {lost} in {where} on a cold {rng.choice(DAYS).lower()} evening. "
                f"Although they had never met, {hero} led {lost} home through the {rng.choice(['rain', 'snow', 'dark', 'wind'])}. "
                f"From that day on, the two of them met every {rng.choice(['morning', 'week', 'spring', 'evening'])}.")
    return rng.choice(PARAGRAPHS)


def _text(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:
        form = rng.choice(["Summarize in one sentence: {p}", "Summarize in two sentences: {p}",
                           "Summarize the main idea: {p}", "Give a short summary of this text: {p}",
                           "What is the main point of this text? {p}", "Write a headline for this text: {p}"])
        return form.format(p=_passage(rng))
    if kind < 0.5:
        if rng.random() < 0.25:
            items = rng.sample(PRODUCTS, rng.randint(2, 4))
            text = "The store sells " + ", ".join(f"{n} for {p} dollars" for n, p in items[:-1]) + \
                   f" and {items[-1][0]} for {items[-1][1]} dollars."
            return f"Extract the product names and prices from this text: {text}"
        if rng.random() < 0.3:
            thing, pros, cons = rng.choice(PROS_CONS)
            return f"Summarize the pros and cons described here: {thing} {pros[0]} and {pros[1]}, but it can {cons[0]} and {cons[1]}."
        form = rng.choice(["Extract the names, dates and places from this text: {p}",
                           "Extract every number and what it measures from this text: {p}",
                           "List the key points of this message: {p}", "List the key points of this email: {p}",
                           "Who is mentioned in this text, and what do they do? {p}"])
        return form.format(p=_passage(rng))
    if kind < 0.75:
        choice = rng.randrange(6)
        if choice == 0:
            return f"Rewrite this sentence in a formal tone: {rng.choice(INFORMAL)}"
        if choice == 1:
            return f"Rewrite this sentence in a polite tone: {rng.choice(RUDE)}"
        if choice == 2:
            return f"{rng.choice(['Correct the grammar', 'Fix the grammar of this sentence', 'Correct the mistakes'])}: {rng.choice(BAD_GRAMMAR)}"
        if choice == 3:
            return f"Rewrite this paragraph in the passive voice: {rng.choice(ACTIVE)}"
        if choice == 4:
            return f"{rng.choice(['Rewrite in simple English for a child', 'Explain this sentence in plain words', 'Rewrite this for a ten-year-old'])}: {rng.choice(TECHNICAL)}"
        day, day2 = rng.sample(DAYS, 2)
        note = rng.choice(NOTES).format(day=day, day2=day2, h=rng.randint(1, 11), h2=rng.randint(4, 9),
                                        r=rng.randint(100, 450), n=rng.randint(2, 9), p=rng.choice(PEOPLE).split()[0])
        return f"Turn these notes into full sentences: {note}"
    choice = rng.randrange(4)
    if choice == 0:
        name = rng.choice(PEOPLE)
        age, city = rng.randint(19, 80), rng.choice(CITIES)
        return f"Convert to JSON with keys name, age and city: {name} is {age} years old and lives in {city}."
    if choice == 1:
        a, b, rows = rng.choice(PAIRS)
        picked = rng.sample(rows, rng.randint(3, min(5, len(rows))))
        return f"Convert this list to a markdown table with columns {a} and {b}: " + ", ".join(f"{x} {y}" for x, y in picked) + "."
    if choice == 2:
        host = rng.choice(["localhost", "db.internal", "10.0.0.5", "api.example.com"])
        return (f'Convert this JSON to YAML: {{"server": {{"host": "{host}", "port": {rng.choice([80, 443, 5432, 8000, 8080, 9090])}}}, '
                f'"debug": {rng.choice(["true", "false"])}, "workers": {rng.randint(1, 16)}}}')
    a, b, rows = rng.choice(PAIRS)
    picked = rng.sample(rows, rng.randint(3, min(5, len(rows))))
    return f"Turn this into a JSON list of objects with keys {a.lower()} and {b.lower()}: " + "; ".join(f"{x} - {y}" for x, y in picked)

# "qa": questions with one short answer, over pools of their own (people, places, things, animals,
# events), none of them the benchmarks' questions; "creative": forms of writing x subjects x a
# twist of style.  Both are for a general prose draft: the target's phrasing of facts, and of stories
QA_BOOKS = ["Pride and Prejudice", "Moby-Dick", "War and Peace", "The Odyssey", "Don Quixote", "Hamlet", "1984",
            "The Great Gatsby", "Frankenstein", "The Little Prince", "Crime and Punishment", "Jane Eyre",
            "The Hobbit", "Les Miserables", "Dracula", "The Divine Comedy", "One Hundred Years of Solitude",
            "Alice's Adventures in Wonderland", "The Origin of Species", "A Brief History of Time"]
QA_INVENTIONS = ["the light bulb", "the telephone", "the printing press", "the steam engine", "the World Wide Web",
                 "penicillin", "the airplane", "the radio", "the telescope", "the microscope", "dynamite",
                 "the periodic table", "the theory of relativity", "the polio vaccine", "the transistor",
                 "the bicycle", "the camera", "the thermometer", "the battery", "the compass"]
QA_COUNTRIES = ["Japan", "Brazil", "Canada", "Australia", "Egypt", "Kenya", "Norway", "Argentina", "India",
                "Mexico", "Germany", "Spain", "Thailand", "Turkey", "Peru", "Vietnam", "Sweden", "Morocco",
                "New Zealand", "Poland", "Chile", "Greece", "Indonesia", "Portugal", "Ireland", "Nigeria"]
QA_LANDMARKS = ["the Eiffel Tower", "Machu Picchu", "the Taj Mahal", "the Colosseum", "Stonehenge",
                "the Statue of Liberty", "Angkor Wat", "the Acropolis", "Petra", "Mount Everest",
                "the Grand Canyon", "the Sahara Desert", "the Great Barrier Reef", "Niagara Falls",
                "the Leaning Tower of Pisa", "Chichen Itza", "the Kremlin", "Table Mountain"]
QA_ANIMALS = ["elephants", "dolphins", "penguins", "octopuses", "bats", "owls", "camels", "kangaroos", "sharks",
              "honeybees", "ants", "giraffes", "wolves", "sea turtles", "hummingbirds", "chameleons", "koalas",
              "polar bears", "salmon", "butterflies", "crows", "horses", "frogs", "whales"]
QA_ANIMAL_ASKS = ["What do {a} eat?", "How long do {a} live?", "Where do {a} live?", "How do {a} sleep?",
                  "How do {a} communicate?", "Are {a} endangered?", "How fast can {a} move?",
                  "What is special about {a}?", "How do {a} raise their young?", "Why are {a} important to their ecosystem?"]
QA_THINGS = ["a microwave oven", "a solar panel", "a vaccine", "a credit card", "an electric motor", "a GPS receiver",
             "a jet engine", "a touch screen", "a nuclear reactor", "a heat pump", "a 3D printer", "a smoke detector",
             "an elevator", "a hydroelectric dam", "a submarine", "a thermostat", "a barcode scanner", "a hearing aid",
             "a wind turbine", "an air conditioner", "a search engine", "a lock and key", "a parachute", "Wi-Fi"]
QA_WHYS = ["Why is the sea salty?", "Why is the sky dark at night?", "Why is ice slippery?",
           "Why can we sometimes see the moon during the day?", "Why does bread go stale?",
           "Why is it so easy to float in the Dead Sea?", "Why does copper turn green?", "Why is snow white?",
           "Why does a moving bicycle stay upright?", "Why is Venus hotter than Mercury?", "Why does popcorn pop?",
           "Why do onions make people cry?", "Why does metal feel colder than wood?", "Why does a boomerang come back?",
           "Why is the desert cold at night?", "Why do we yawn?", "Why do cats purr?", "Why do stars twinkle?",
           "Why do our ears pop on an airplane?", "Why does hot air rise?", "Why do we get goosebumps?",
           "Why does the moon have phases?"]
QA_EVENTS = ["the fall of the Berlin Wall", "the first moon landing", "the signing of the Magna Carta",
             "the end of World War II", "the sinking of the Titanic", "the start of the French Revolution",
             "the discovery of America by Columbus", "the first modern Olympic Games", "the fall of Rome",
             "the invention of writing", "the Black Death", "the American Civil War", "the building of the pyramids",
             "the first flight of the Wright brothers", "the founding of the European Union", "the Cold War"]
QA_UNITS = [("meters", "kilometer"), ("grams", "kilogram"), ("seconds", "day"), ("inches", "foot"), ("ounces", "pound"),
            ("milliliters", "liter"), ("days", "leap year"), ("feet", "mile"), ("minutes", "week"), ("cups", "gallon"),
            ("bytes", "kilobyte"), ("centimeters", "meter")]
QA_WORDS = ["serendipity", "ephemeral", "ubiquitous", "nostalgia", "resilience", "paradox", "empathy", "metaphor",
            "algorithm", "entropy", "irony", "hypothesis", "democracy", "photosynthesis", "catalyst", "inflation",
            "biodiversity", "procrastination", "renaissance", "equinox"]
QA_PAIRS = [("weather", "climate"), ("a meteor", "a meteorite"), ("an alligator", "a crocodile"), ("speed", "velocity"),
            ("a hurricane", "a tornado"), ("mass", "weight"), ("a frog", "a toad"), ("an ocean", "a sea"),
            ("a star", "a planet"), ("baking soda", "baking powder"), ("a lake", "a pond"), ("a fruit", "a vegetable"),
            ("RAM", "storage"), ("an atom", "a molecule"), ("a democracy", "a republic"), ("a mammal", "a reptile"),
            ("a violin", "a viola"), ("stocks", "bonds"), ("a simile", "a metaphor"), ("a city", "a town")]
QA_TEMPLATES = [
    lambda r: f"Who wrote {r.choice(QA_BOOKS)}?",
    lambda r: f"What is {r.choice(QA_BOOKS)} about?",
    lambda r: f"Who invented {r.choice(QA_INVENTIONS)}?",
    lambda r: f"When was {r.choice(QA_INVENTIONS)} invented, and why did it matter?",
    lambda r: f"What is the capital of {r.choice(QA_COUNTRIES)}?",
    lambda r: f"What language do people speak in {r.choice(QA_COUNTRIES)}?",
    lambda r: f"What is {r.choice(QA_COUNTRIES)} known for?",
    lambda r: f"What currency is used in {r.choice(QA_COUNTRIES)}?",
    lambda r: f"Where is {r.choice(QA_LANDMARKS)}?",
    lambda r: f"Why is {r.choice(QA_LANDMARKS)} famous?",
    lambda r: f"How old is {r.choice(QA_LANDMARKS)}?",
    lambda r: r.choice(QA_ANIMAL_ASKS).format(a=r.choice(QA_ANIMALS)),
    lambda r: f"How does {r.choice(QA_THINGS)} work?",
    lambda r: f"What is {r.choice(QA_THINGS)} used for?",
    lambda r: r.choice(QA_WHYS),
    lambda r: f"When did {r.choice(QA_EVENTS)} happen?",
    lambda r: f"What caused {r.choice(QA_EVENTS)}?",
    lambda r: f"Why was {r.choice(QA_EVENTS)} important?",
    lambda r: (lambda u: f"How many {u[0]} are in a {u[1]}?")(r.choice(QA_UNITS)),
    lambda r: f"What does the word {r.choice(QA_WORDS)} mean?",
    lambda r: f"Use the word {r.choice(QA_WORDS)} in a sentence and explain it.",
    lambda r: (lambda a, b: f"What is the difference between {a} and {b}?")(*r.choice(QA_PAIRS)),
    lambda r: f"Briefly, what is {r.choice(CHAT_TOPICS)}?",
    lambda r: f"In one paragraph, how does {r.choice(CHAT_TOPICS)} affect everyday life?",
    lambda r: f"Is it true that {r.choice(QA_ANIMALS)} are {r.choice(['colorblind', 'mammals', 'social', 'nocturnal', 'intelligent'])}?",
]
CREATIVE_FORMS = ["a short story", "a poem", "a haiku", "a limerick", "a fable with a moral", "a diary entry",
                  "a letter", "a short dialogue", "song lyrics", "a fairy tale", "a short mystery", "a postcard message",
                  "a speech", "a product description", "a short scene for a play", "a sonnet", "a riddle and its answer",
                  "a travel journal entry", "a news report from the future", "a recipe written as a poem"]
CREATIVE_SUBJECTS = [
    "a lighthouse in a storm", "a city built on the back of a whale", "the last bookshop on Earth", "a stolen umbrella",
    "an inventor whose machines come alive", "a village where it never stops snowing", "a cat who runs a hotel",
    "the first day at a new school", "a message in a bottle", "a forgotten toy in an attic", "a garden on Mars",
    "a baker who bakes dreams", "a river that flows uphill", "twin sisters who swap lives", "a clockmaker's apprentice",
    "an elephant who paints", "a storm chaser", "the night market in a busy city", "an old piano",
    "a detective who is a dog", "the smell of rain", "a mountain that sings", "a time traveler stuck in 1850",
    "a friendship between a crow and a scarecrow", "a lost astronaut", "an underwater kingdom", "a broken compass",
    "a street musician", "the first snow of winter", "a robot gardener", "a ship made of paper", "a city without cars",
    "a grandfather's pocket watch", "a summer at the seaside", "a lonely satellite", "a tea shop run by ghosts",
]
CREATIVE_STYLES = ["", "", "", " for children", " with a surprise ending", " in a funny tone", " in a sad tone",
                   " in under 100 words", " told in the first person", " set in the distant future",
                   " in the style of an old legend", " that rhymes", " full of vivid colors", " with a hopeful ending"]


def _qa(rng: random.Random) -> str:
    return rng.choice(QA_TEMPLATES)(rng)


def _creative(rng: random.Random) -> str:
    verb = rng.choice(["Write", "Compose", "Create", "Could you write"])
    return f"{verb} {rng.choice(CREATIVE_FORMS)} about {rng.choice(CREATIVE_SUBJECTS)}{rng.choice(CREATIVE_STYLES)}" \
           + ("?" if verb == "Could you write" else ".")


_MAKERS = {"code": _code, "math": _math, "chat": _chat, "scripts": _scripts, "text": _text, "qa": _qa,
          "creative": _creative}


def domain_prompts(domain: str, n: int, seed: int = 0, exclude=()) -> list[str]:
    """Up to `n` distinct user prompts for `domain`, the same for the same seed and lists; never a
    benchmark's prompt nor a near copy of one (near_measured).

    `exclude` holds prompts already used (say by another seed's data set), so that data
    sets made with different seeds never share a prompt.
    """
    if domain not in _MAKERS:
        raise ValueError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    rng = random.Random(f"{domain}-{seed}")
    skip = set(exclude)
    near = near_measured()
    seen: dict[str, None] = {}
    for _ in range(50 * n):
        if len(seen) == n:
            break
        p = _MAKERS[domain](rng)
        if p not in skip and p not in seen and not near(p):
            seen[p] = None
    return list(seen)


def measured_prompts() -> set[str]:
    """The prompts the benchmarks measure drafts on: the built-in workload and, in a checkout,
    every workload in bench/ (bench/*.jsonl: the held-out and the fresh sets).  Training never
    uses them."""
    from memspec.bench.policies import load_workload

    bench = Path(__file__).resolve().parents[2] / "bench"
    workloads = [None, *sorted(str(p) for p in bench.glob("*.jsonl"))]
    return {w["prompt"] for path in workloads for w in load_workload(path)}


STOPWORDS = frozenset(
    "a an the of to in on for and or is are was were be been it its this that these those what which who whom "
    "how why when where do does did your you me my i we our us by with from at as into than then so if can could "
    "would should will about some any each every there their they them he she his her has have had not no".split())
NEAR_SHARE = 0.6  # a prompt holding this share of a measured prompt's content words is a near copy of it
NGRAM = 8  # a prompt sharing this many words in a row with a measured prompt holds a copy of part of it


def ngram_words(text: str) -> list[str]:
    """The words of `text` as the n-gram test reads them: runs of letters or digits, lower-cased,
    every number the one word "#" (a prompt that differs from another in its numbers only is the
    same prompt: "What is 5 multiplied by 24?" against "17 multiplied by 24")."""
    return ["#" if w[0].isdigit() else w for w in re.findall(r"[a-z]+|[0-9]+", text.lower())]


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """Every run of `n` consecutive words of `text` (ngram_words); none where it has fewer."""
    words = ngram_words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def content_words(text: str) -> frozenset[str]:
    """The words of `text` that carry its task: lower-cased, stopwords out, a plural's s cut."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return frozenset(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
                     for w in words if w not in STOPWORDS)


def copied_runs(measured, prompts) -> list[tuple[str, str, str, str]]:
    """(source, prompt, measured prompt, the shared words) for each (source, prompt) of `prompts`
    that holds NGRAM words in a row of a prompt of `measured`: a benchmark no prompt of `prompts`
    was trained near has none."""
    owner = {g: m for m in measured for g in ngrams(m)}
    hits = []
    for source, prompt in prompts:
        words = ngram_words(prompt)
        first = next((g for g in (tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)) if g in owner),
                     None)
        if first:
            hits.append((source, prompt, owner[first], " ".join(first)))
    return hits


class NearCopies:
    """Whether a prompt is one of `measured` or a near copy of one: it holds at least NEAR_SHARE of
    that prompt's content words (all of them where it has fewer than three: "What is the capital of
    France?" is {capital, france}), or NGRAM of its words in a row (a passage, a function or a
    traceback copied out of a long prompt, whatever words surround it).  So "Write a JavaScript
    function to check whether two strings are anagrams." is a near copy of "Write a Python function
    that checks whether two strings are anagrams.", and "What is 5 multiplied by 24? Show your work
    step by step." of "What is 17 multiplied by 24? ...", while "Write a Python function to reverse
    a string." is neither."""

    def __init__(self, measured):
        self.prompts = frozenset(measured)  # a prompt of stopwords only is caught as itself
        self.grams = frozenset(g for m in measured for g in ngrams(m))
        self.need: list[int] = []
        self.sets: list[frozenset[str]] = []
        self.by_word: dict[str, list[int]] = {}
        for m in measured:
            words = content_words(m)
            if not words:
                continue
            i = len(self.sets)
            self.sets.append(words)
            self.need.append(len(words) if len(words) < 3 else math.ceil(NEAR_SHARE * len(words)))
            for w in words:
                self.by_word.setdefault(w, []).append(i)

    def __call__(self, prompt: str) -> bool:
        if prompt in self.prompts or not self.grams.isdisjoint(ngrams(prompt)):
            return True
        words = content_words(prompt)
        shared: dict[int, int] = {}
        for w in words:
            for i in self.by_word.get(w, ()):
                shared[i] = shared.get(i, 0) + 1
        return any(k >= self.need[i] for i, k in shared.items())


@lru_cache(maxsize=1)
def near_measured() -> NearCopies:
    """The test for near copies of measured_prompts() (built once)."""
    return NearCopies(measured_prompts())
